"""The checkpoint library (deepspeed_ext) never imports the trainer (megatron), at module
or function level: densify asks the trainer's entry point to check a replay's flags, and
moc-plan asks it for a config's model shape, instead (tests/test_layering.py checks the
same with relative imports resolved)."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "deepspeed_ext")
ALLOWED: set = set()
"""Modules allowed to import the trainer, relative to ``deepspeed_ext/``: none."""


def _megatron_imports(path: str):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name == "megatron" or name.startswith("megatron."):
                yield f"{os.path.relpath(path, PACKAGE)}:{node.lineno}: {name}"


def test_no_module_of_the_library_imports_the_trainer():
    found, scanned = [], 0
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            path = os.path.join(root, name)
            if not name.endswith(".py"):
                continue
            scanned += 1
            if os.path.relpath(path, PACKAGE) not in ALLOWED:
                found.extend(_megatron_imports(path))
    assert scanned > 20  # the walk really saw the package
    assert found == []
