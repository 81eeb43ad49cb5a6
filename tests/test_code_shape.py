"""One shape rule for the whole repository: sizes that fit in a head, and no private name
of ours reached from another module.

- Library code (``deepspeed_ext/``, ``megatron/``, ``pretrain_gpt_moe.py``, ``tools/``,
  ``scripts/``): no file over 600 lines, no class over 300, no function over 60.
- Programs that measure (``benchmarks/``, ``experiments/``): files up to 800 lines, the
  same class and function limits.
- ``tests/``: no file over 800 (a test may be a long table of cases).
- :data:`SIZE_EXCEPTIONS` names what may be larger, each with its reason; a test fails
  when one is no longer needed.
- No ``from <our module> import _name`` and no ``<our module>._name`` where the module was
  bound by an import, anywhere in the repository (a test uses public seams).
  Third-party privates (DeepSpeed's, torch's, argparse's) are not ours to fix and are not
  counted. Attribute access on instances (``obj._x``) cannot be resolved without types
  and is left to review.
"""

import ast
import os
from typing import Dict, Iterator, List, Tuple

from tests.launch import REPO

OURS = ("deepspeed_ext", "megatron.training", "megatron.model", "megatron.data",
        "megatron.errors", "megatron.lazy_compile", "tests", "benchmarks", "benchlib",
        "experiments", "scripts", "gpu_checks", "tools", "pretrain_gpt_moe")
"""Our modules' names as imported (a benchmark imports ``benchlib.x`` with its folder on
``sys.path``; ``megatron.core`` is megatron-core's, not ours)."""

LIMITS = {"file": 600, "class": 300, "function": 60, "other_file": 800}

LIBRARY = ("deepspeed_ext", "megatron", "pretrain_gpt_moe.py", "tools", "scripts")
"""Held to the library's limits."""
PROGRAMS = ("benchmarks", "experiments")
"""Files up to ``other_file`` lines; classes and functions as the library's."""

SIZE_EXCEPTIONS: Dict[str, str] = {}
"""``path`` or ``path:name`` (as :func:`size_problems` prints it, without the count) ->
why it may be larger. Today none."""


def _python_files(*tops: str) -> Iterator[str]:
    for top in tops:
        if top.endswith(".py"):
            if os.path.exists(top):
                yield top
            continue
        for d, dirs, files in os.walk(top):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", ".venv")]
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(d, f)


def _limits(top: str) -> Tuple[int, bool]:
    """(file limit, whether classes and functions are counted) for a top-level entry."""
    if top in LIBRARY:
        return LIMITS["file"], True
    return LIMITS["other_file"], top in PROGRAMS


def size_problems(root: str = REPO) -> List[str]:
    """Every file, class and function over its limit, as ``path[:name] lines``, less the
    :data:`SIZE_EXCEPTIONS`."""
    return [p for p in all_sizes_over(root) if p.rsplit(" ", 2)[0] not in SIZE_EXCEPTIONS]


def all_sizes_over(root: str = REPO) -> List[str]:
    """Every file, class and function over its limit, exceptions included."""
    out = []
    for top in LIBRARY + PROGRAMS + ("tests",):
        file_limit, inside = _limits(top)
        for path in _python_files(os.path.join(root, top)):
            with open(path, encoding="utf-8") as f:
                source = f.read()
            rel = os.path.relpath(path, root)
            lines = source.count("\n")
            if lines > file_limit:
                out.append(f"{rel} {lines} lines")
            if inside:
                out += _long_definitions(source, rel)
    return out


def _long_definitions(source: str, rel: str) -> List[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        kind = ("class" if isinstance(node, ast.ClassDef) else
                "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else None)
        if kind and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
            out.append(f"{rel}:{node.name} {node.end_lineno - node.lineno + 1} lines")
    return out


def _ours(module: str) -> bool:
    return any(module == o or module.startswith(o + ".") for o in OURS)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: str, rel: str) -> List[str]:
    """``rel:line name`` for each private name of another of our modules used in ``path``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    modules = set()  # local names bound to our modules
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):
                    modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and _ours(node.module):
            for a in node.names:
                if _private(a.name):
                    out.append(f"{rel}:{node.lineno} from {node.module} import {a.name}")
                else:
                    modules.add(a.asname or a.name)  # may be a module or a public name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules and base.id not in ("self", "cls"):
                out.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return out


def all_private_uses(root: str = REPO) -> List[str]:
    out = []
    for path in _python_files(*(os.path.join(root, t) for t in
                               LIBRARY + PROGRAMS + ("tests",))):
        out += private_uses(path, os.path.relpath(path, root))
    return out


def test_sizes():
    assert size_problems() == []


def test_every_size_exception_is_still_needed():
    over = {p.rsplit(" ", 2)[0] for p in all_sizes_over()}
    assert sorted(set(SIZE_EXCEPTIONS) - over) == []


def test_no_private_name_of_ours_crosses_a_module():
    assert all_private_uses() == []


def test_the_checks_can_fail(tmp_path):
    (tmp_path / "deepspeed_ext").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "deepspeed_ext" / "big.py").write_text(f"def long():\n{body}\n")
    assert size_problems(str(tmp_path)) == ["deepspeed_ext/big.py:long 62 lines"]
    for top in ("megatron/training", "scripts", "benchmarks"):  # the trainer and programs too
        (tmp_path / top).mkdir(parents=True)
        (tmp_path / top / "big.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "benchmarks" / "long_file.py").write_text("x = 1\n" * 801)
    (tmp_path / "megatron" / "training" / "long_file.py").write_text("x = 1\n" * 601)
    assert sorted(size_problems(str(tmp_path))) == [
        "benchmarks/big.py:long 62 lines", "benchmarks/long_file.py 801 lines",
        "deepspeed_ext/big.py:long 62 lines", "megatron/training/big.py:long 62 lines",
        "megatron/training/long_file.py 601 lines", "scripts/big.py:long 62 lines"]
    (tmp_path / "tests").mkdir()
    user = tmp_path / "tests" / "test_x.py"
    user.write_text("from deepspeed_ext.store import latest\n"
                    "from deepspeed_ext.store.latest import _roll\n"
                    "import deepspeed_ext.format.storage as st\n"
                    "latest._helper(1)\nst._tmp_path('p')\nself_like = object()\n"
                    "import argparse\nargparse._HelpAction\n")
    assert private_uses(str(user), "tests/test_x.py") == [
        "tests/test_x.py:2 from deepspeed_ext.store.latest import _roll",
        "tests/test_x.py:4 latest._helper", "tests/test_x.py:5 st._tmp_path"]
