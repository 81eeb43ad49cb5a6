"""The import layering of ``deepspeed_ext``: no import cycle anywhere in the package, and
no module importing one of a higher layer.

Every import counts, at module level or inside a function: an import moved into a
function to dodge a cycle still ties the two modules together (and runs at a moment no
reader of the module expects). The graph is read from the sources with ``ast``, so
nothing is imported.

The layers, lowest first (:data:`LAYERS`): ``runtime`` (the process: logging, retries,
process groups, the outcome collectives), ``policy`` (pure plans: PEC, write plans, lost
tokens, redundancy, exact recovery's windows), ``format`` (a checkpoint's bytes and
metadata), ``store`` (a save directory's life), ``engine`` (what a DeepSpeed engine holds
and its host copies), ``keeper`` (the node's keeper process, its client and its typed
jobs), ``modes`` (the single-level, two-level and exact backends and their shared
session), ``facade`` (``MoCCheckpointer``, ``enable_moc_checkpointing``) and ``tools``
(``moc-ckpt``, ``moc-plan``).
"""

import fnmatch
import importlib.util
import os
from typing import Dict, List, Optional, Sequence, Set, Tuple

from tests.launch import REPO

PACKAGE = "deepspeed_ext"

LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("runtime", ("deepspeed_ext.runtime", "deepspeed_ext.runtime.*",
                 "deepspeed_ext.private_dir", "deepspeed_ext.node_layout")),
    ("policy", ("deepspeed_ext.policy", "deepspeed_ext.policy.*")),
    ("format", ("deepspeed_ext.format", "deepspeed_ext.format.*")),
    ("store", ("deepspeed_ext.store", "deepspeed_ext.store.*")),
    ("engine", ("deepspeed_ext.engine", "deepspeed_ext.engine.*")),
    # the keeper process, its client and its wire format (the typed jobs, the run id)
    ("keeper", ("deepspeed_ext.keeper", "deepspeed_ext.keeper.*", "deepspeed_ext.jobs",
                "deepspeed_ext.job_identity")),
    # the backends and what they share
    ("modes", ("deepspeed_ext.two_level", "deepspeed_ext.two_level.*", "deepspeed_ext.exact",
               "deepspeed_ext.exact.*", "deepspeed_ext.snapshot", "deepspeed_ext.slot_layouts",
               "deepspeed_ext.peers",
               "deepspeed_ext.state", "deepspeed_ext.session", "deepspeed_ext.storage_load",
               "deepspeed_ext.single_level", "deepspeed_ext.config")),
    ("facade", ("deepspeed_ext", "deepspeed_ext.checkpointer", "deepspeed_ext.patch")),
    ("tools", ("deepspeed_ext.cli", "deepspeed_ext.cli.*", "deepspeed_ext.planning",
               "deepspeed_ext.planning.*")),
]
"""Layers, lowest first, as module name patterns; a module is in the first layer one of
whose patterns it matches. A module may import modules of its own layer and of lower
ones. Every module must be in one: a new module is placed here (and in
``docs/make_architecture.py``, whose bands are these; a test below checks they agree)."""


def _import_reader():
    """``docs/make_architecture.py``, which reads the package's imports for the picture:
    the layering rules here and the picture read the same graph."""
    spec = importlib.util.spec_from_file_location(
        "make_architecture", os.path.join(REPO, "docs", "make_architecture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_graph(root: str = REPO) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (at module level or in a function)."""
    modules, edges = _import_reader().import_edges(root)
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    for edge in edges:
        graph[edge.source].add(edge.target)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one
    module (Tarjan's algorithm, iterative), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    out = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def layer_of(module: str, layers: Sequence[Tuple[str, Tuple[str, ...]]] = LAYERS) -> Optional[int]:
    """Index in ``layers`` of the layer holding ``module``; None: above every layer."""
    for i, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    return None


def upward_imports(graph: Dict[str, Set[str]],
                   layers: Sequence[Tuple[str, Tuple[str, ...]]] = LAYERS) -> List[str]:
    """``"a -> b"`` for every import of a module ``b`` above ``a``'s layer."""
    out = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module, layers)
        if mine is None:
            continue
        for target in sorted(targets):
            theirs = layer_of(target, layers)
            if theirs is None or theirs > mine:
                out.append(f"{module} -> {target}")
    return out


def test_no_cycle_in_the_package_and_every_import_goes_downwards():
    graph = import_graph()
    for name, patterns in LAYERS:
        assert any(LAYERS[layer_of(m)][0] == name for m in graph), \
            f"layer {name} ({patterns}) matches no module of {PACKAGE}"
    assert [m for m in graph if layer_of(m) is None] == []
    assert cycles(graph) == []
    assert upward_imports(graph) == []


def test_the_checker_finds_a_function_level_cycle_and_an_upward_import(tmp_path):
    """The checks can fail: a cycle closed by an import inside a function (the old
    ``commit`` <-> ``manifest`` shape) and a format module importing the store."""
    pkg = tmp_path / PACKAGE
    for sub in ("", "format", "store"):
        (pkg / sub).mkdir(exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "format" / "manifest.py").write_text(
        "def prepare():\n    from deepspeed_ext.store.commit import claim_dir\n")
    (pkg / "store" / "commit.py").write_text("from deepspeed_ext.format import manifest\n")
    graph = import_graph(str(tmp_path))
    assert graph["deepspeed_ext.format.manifest"] == {"deepspeed_ext.store.commit"}
    assert cycles(graph) == [["deepspeed_ext.format.manifest", "deepspeed_ext.store.commit"]]
    assert upward_imports(graph) == ["deepspeed_ext.format.manifest -> deepspeed_ext.store.commit"]


def test_the_checker_finds_a_cycle_in_the_top_layer_and_a_lower_module_importing_it(tmp_path):
    """Modules above the named layers are held to the same rules: the old
    ``checkpointer`` <-> ``two_level`` shape (each importing the other, one side inside
    a function) is a cycle, and a runtime module importing the checkpointer goes up."""
    pkg = tmp_path / PACKAGE
    for sub in ("", "runtime"):
        (pkg / sub).mkdir(exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "checkpointer.py").write_text(
        "def start():\n    from deepspeed_ext.two_level import TwoLevel\n")
    (pkg / "two_level.py").write_text("from deepspeed_ext.checkpointer import MoCCheckpointError\n")
    (pkg / "runtime" / "outcomes.py").write_text("import deepspeed_ext.checkpointer\n")
    graph = import_graph(str(tmp_path))
    assert [m for m in graph if layer_of(m) is None] == []
    assert cycles(graph) == [["deepspeed_ext.checkpointer", "deepspeed_ext.two_level"]]
    assert upward_imports(graph) == ["deepspeed_ext.runtime.outcomes -> deepspeed_ext.checkpointer",
                                     "deepspeed_ext.two_level -> deepspeed_ext.checkpointer"]


def test_the_picture_draws_the_layers_this_test_enforces():
    """docs/make_architecture.py's bands are these layers, in this order, and it puts
    every module of the package in the band this test does: the picture shows the rule."""
    drawing = _import_reader()
    assert [name for name, _ in drawing.LAYERS] == [name for name, _ in LAYERS]
    misplaced = [(m, drawing.layer_of(m), LAYERS[layer_of(m)][0]) for m in import_graph()
                 if layer_of(m) is None or drawing.layer_of(m) != LAYERS[layer_of(m)][0]]
    assert misplaced == []


# ------------------------------------------------- the library below the trainer, and the
# trainer's own layers: data and model below training

TRAINER_IMPORT_EXCEPTIONS: Dict[str, str] = {}
"""Modules of ``deepspeed_ext`` allowed to import ``megatron``, each with its reason. A
test below fails when an exception is no longer needed."""

LOWER_TRAINER_PACKAGES = ("megatron/data", "megatron/model")
"""Packages of the trainer below ``megatron.training``: they import nothing of it (a
shared error type lives in ``megatron.errors``)."""


def _module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-len(".py")].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def imported_modules(root: str, path: str) -> List[Tuple[int, str]]:
    """(line, module) for every import in the source file ``path`` under ``root``, at
    module level or in a function, relative imports resolved (``from x import y`` counts
    as ``x`` and ``x.y``)."""
    import ast
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = _module_name(root, path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[:len(package) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}")
                                              for a in node.names]
    return found


def imports_of_prefix(root: str, folder: str, prefix: str) -> List[str]:
    """``"path:line: module"`` for every import of ``prefix`` or a module below it by
    the source files under ``root/folder``."""
    out = []
    for dirpath, _, files in os.walk(os.path.join(root, folder)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            for line, module in imported_modules(root, path):
                if module == prefix or module.startswith(prefix + "."):
                    out.append(f"{rel}:{line}: {module}")
    return sorted(set(out))


def trainer_layering_problems(root: str = REPO) -> List[str]:
    """Imports that break the trainer's layering: ``deepspeed_ext`` importing
    ``megatron`` (outside :data:`TRAINER_IMPORT_EXCEPTIONS`), ``megatron.data`` or
    ``megatron.model`` importing ``megatron.training``."""
    problems = [p for p in imports_of_prefix(root, PACKAGE, "megatron")
                if p.split(":", 1)[0] not in TRAINER_IMPORT_EXCEPTIONS]
    for folder in LOWER_TRAINER_PACKAGES:
        problems += imports_of_prefix(root, folder, "megatron.training")
    return problems


def test_the_library_imports_no_trainer_and_data_and_model_import_no_training():
    assert trainer_layering_problems() == []
    for folder in (PACKAGE, *LOWER_TRAINER_PACKAGES):  # the walks really saw the code
        assert len(imports_of_prefix(REPO, folder, folder.split("/")[0])) > 5, folder


def test_every_trainer_import_exception_is_still_needed():
    """An exception whose module no longer imports the trainer is removed from the list
    (it would let a new trainer import in that module pass unseen): the modules that import
    the trainer are exactly the exceptions (today none)."""
    users = {p.split(":", 1)[0] for p in imports_of_prefix(REPO, PACKAGE, "megatron")}
    assert sorted(users) == sorted(TRAINER_IMPORT_EXCEPTIONS)


def test_the_trainer_layering_check_finds_each_kind_of_upward_import(tmp_path):
    """The check can fail: a library module importing the trainer's parser inside a
    function (the old densify flag check), a data module importing the training errors
    with an absolute import and a model module with a relative one."""
    for folder in ("deepspeed_ext/cli", "megatron/data", "megatron/model", "megatron/training"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "deepspeed_ext" / "cli" / "replay.py").write_text(
        "import json\n\ndef parser():\n"
        "    from megatron.training.arguments import build_parser\n    return build_parser()\n")
    (tmp_path / "deepspeed_ext" / "cli" / "fine.py").write_text("from deepspeed_ext import cli\n")
    (tmp_path / "megatron" / "data" / "tokenizer.py").write_text(
        "from megatron.errors import ConfigError\nimport megatron.training.errors\n")
    (tmp_path / "megatron" / "model" / "gpt.py").write_text(
        "from ..training import mpu\nfrom ..errors import ConfigError\n")
    assert trainer_layering_problems(str(tmp_path)) == [
        "deepspeed_ext/cli/replay.py:4: megatron.training.arguments",
        "deepspeed_ext/cli/replay.py:4: megatron.training.arguments.build_parser",
        "megatron/data/tokenizer.py:2: megatron.training.errors",
        "megatron/model/gpt.py:1: megatron.training",
        "megatron/model/gpt.py:1: megatron.training.mpu",
    ]
