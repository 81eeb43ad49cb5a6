"""The repository's import layering: no import cycle anywhere, and no module importing one
of a higher layer.

Every import counts, at module level or inside a function: an import moved into a
function to dodge a cycle still ties the two modules together (and runs at a moment no
reader of the module expects). The graph is read from the sources with ``ast`` by
``docs/make_architecture.py``, which draws it, so nothing is imported.

Two sets of layers. The library's, lowest first (:data:`LAYERS`): ``runtime`` (the
process: logging, retries, process groups, the outcome collectives), ``policy`` (pure
plans: PEC, write plans, lost tokens, redundancy, exact recovery's windows), ``format`` (a
checkpoint's bytes and metadata), ``store`` (a save directory's life), ``engine`` (what a
DeepSpeed engine holds and its host copies), ``keeper`` (the node's keeper process, its
client and its typed jobs), ``modes`` (the single-level, two-level and exact backends and
their shared session), ``facade`` (``MoCCheckpointer``, ``enable_moc_checkpointing``) and
``tools`` (``moc-ckpt``, ``moc-plan``).

The trainer's, over the whole repository (:data:`TRAINER_LAYERS`): ``library``
(``deepspeed_ext``, which imports nothing of ``megatron``), ``base`` (``megatron.errors``,
``megatron.lazy_compile``), ``data``, ``model``, ``training`` (``megatron``'s
subpackages) and ``programs`` (``pretrain_gpt_moe.py``, ``tools/``, ``scripts/``,
``benchmarks/``, ``experiments/``), where no program imports another program's modules
(:data:`PROGRAMS`). A program folder is on ``sys.path`` when its files run, so their bare
imports (``from benchlib.model import ...``) are read as the folder's own modules first.
"""

import fnmatch
import functools
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
               "deepspeed_ext.planning.*", "deepspeed_ext.supervisor",
               "deepspeed_ext.supervisor.*", "deepspeed_ext.interop",
               "deepspeed_ext.interop.*")),
]
"""Layers, lowest first, as module name patterns; a module is in the first layer one of
whose patterns it matches. A module may import modules of its own layer and of lower
ones. Every module must be in one: a new module is placed here (and in
``docs/make_architecture.py``, whose bands are these; a test below checks they agree)."""


def _import_reader():
    """``docs/make_architecture.py``, which reads the repository's imports for the
    pictures: the layering rules here and the pictures read the same graph."""
    spec = importlib.util.spec_from_file_location(
        "make_architecture", os.path.join(REPO, "docs", "make_architecture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_graph(root: str = REPO, tops: Tuple[str, ...] = (PACKAGE,)) -> Dict[str, Set[str]]:
    """Module -> the modules it imports (at module level or in a function), over the
    modules under ``root``'s ``tops`` (default: the library)."""
    modules, edges = _import_reader().import_edges(root, tops)
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


# ------------------------------------------------------------- the trainer's layers, over
# the whole repository

TRAINER_LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("library", ("deepspeed_ext", "deepspeed_ext.*")),
    # what every layer of the trainer may raise or use: the error types, compiled helpers
    ("base", ("megatron", "megatron.errors", "megatron.lazy_compile")),
    ("data", ("megatron.data", "megatron.data.*")),
    ("model", ("megatron.model", "megatron.model.*")),
    ("training", ("megatron.training", "megatron.training.*")),
    ("programs", ("pretrain_gpt_moe", "tools.*", "scripts.*", "benchmarks.*", "experiments.*")),
]
"""The trainer's layers, lowest first, over the repository's modules (a program folder's
modules are named after it: ``benchmarks.benchlib.model``). Every module must be in one:
a new ``megatron`` subpackage is placed here and in ``docs/make_architecture.py``
(``MEGATRON``; a test below checks they agree)."""

PROGRAMS = ("pretrain_gpt_moe", "tools", "scripts", "benchmarks", "experiments")
"""The programs: the entry point and the program folders. None imports another's modules:
what two of them share belongs in a layer below."""

IMPORT_EXCEPTIONS: Dict[str, str] = {}
"""Imports ``"a -> b"`` of the repository allowed to break a rule below, each with its
reason. A test below fails when an exception is no longer needed. Today none."""


@functools.lru_cache(maxsize=None)
def repository_graph(root: str = REPO) -> Dict[str, Set[str]]:
    """Module -> the modules it imports, over everything the trainer's picture reads
    (``docs/make_architecture.py``'s ``REPOSITORY``); read once per root (callers do not
    change it)."""
    return import_graph(root, _import_reader().REPOSITORY)


def program_of(module: str) -> Optional[str]:
    """The program (:data:`PROGRAMS`) ``module`` belongs to; None: not a program's."""
    top = module.split(".")[0]
    return top if top in PROGRAMS else None


def cross_program_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``"a -> b"`` for every import of one program's module by another program."""
    return [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
            if program_of(a) and program_of(b) and program_of(a) != program_of(b)]


def repository_problems(graph: Dict[str, Set[str]],
                        exceptions: Optional[Dict[str, str]] = None) -> List[str]:
    """What breaks the trainer's layering once the imports of ``exceptions`` (default
    :data:`IMPORT_EXCEPTIONS`) are left out: ``cycle: a, b, ...``, ``upward: a -> b``
    (:data:`TRAINER_LAYERS`) and ``program: a -> b`` (:data:`PROGRAMS`)."""
    allowed = IMPORT_EXCEPTIONS if exceptions is None else exceptions
    kept = {a: {b for b in targets if f"{a} -> {b}" not in allowed}
            for a, targets in graph.items()}
    return ([f"cycle: {', '.join(c)}" for c in cycles(kept)]
            + [f"upward: {p}" for p in upward_imports(kept, TRAINER_LAYERS)]
            + [f"program: {p}" for p in cross_program_imports(kept)])


def test_no_cycle_no_upward_import_and_no_program_importing_another_in_the_repository():
    graph = repository_graph()
    for name, patterns in TRAINER_LAYERS:
        assert any(TRAINER_LAYERS[layer_of(m, TRAINER_LAYERS)][0] == name for m in graph
                   if layer_of(m, TRAINER_LAYERS) is not None), \
            f"layer {name} ({patterns}) matches no module"
    assert [m for m in graph if layer_of(m, TRAINER_LAYERS) is None] == []
    assert repository_problems(graph) == []
    # the reader saw the programs' imports: of their own folder's modules by bare name,
    # and of the trainer and the library
    for program in PROGRAMS:
        assert any(program_of(m) == program and graph[m] for m in graph), program
    for folder in ("scripts", "benchmarks"):
        assert any(program_of(b) == folder for m in graph if program_of(m) == folder
                   for b in graph[m]), folder


def test_every_import_exception_is_still_needed():
    """An exception whose import is gone or breaks no rule any more is removed from the
    list (it would let a new import of the same pair pass unseen)."""
    graph = repository_graph()
    for pair in IMPORT_EXCEPTIONS:
        source, target = pair.split(" -> ")
        assert target in graph.get(source, set()), f"{pair}: no such import any more"
        others = {p: why for p, why in IMPORT_EXCEPTIONS.items() if p != pair}
        assert repository_problems(graph, others) != [], f"{pair}: breaks no rule any more"


def _write_tree(root, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_repository_checks_find_a_cycle_an_upward_import_and_a_program_importing_another(
        tmp_path):
    """The checks can fail: a cycle inside ``megatron.training`` closed by an import in a
    function, a model module importing training (a relative import) and a data module
    (an absolute one), a benchmark importing a script's module by bare name. A program
    folder's bare imports are its own modules first (``checkpoint_bench`` is the
    benchmark, not the script of the same name)."""
    _write_tree(tmp_path, {
        "megatron/errors.py": "",
        "megatron/training/__init__.py": "",
        "megatron/training/mpu.py": "",
        "megatron/training/step.py": "from megatron.training.loaders import build\n",
        "megatron/training/loaders.py": "def build():\n    from megatron.training import step\n",
        "megatron/model/__init__.py": "",
        "megatron/model/gpt.py": "from ..training import mpu\nfrom ..errors import ConfigError\n",
        "megatron/data/__init__.py": "",
        "megatron/data/tokenizer.py": "from megatron.errors import ConfigError\n"
                                      "import megatron.training.errors\n",
        "pretrain_gpt_moe.py": "from megatron.training import step\n",
        "scripts/gpu_checks/__init__.py": "",
        "scripts/gpu_checks/common.py": "",
        "scripts/gpu_check.py": "from gpu_checks.common import FAIL\n",
        "scripts/checkpoint_bench.py": "",
        "benchmarks/benchlib/__init__.py": "",
        "benchmarks/benchlib/model.py": "from . import ranks\n",
        "benchmarks/benchlib/ranks.py": "import torch\n",
        "benchmarks/checkpoint_bench.py": "import json\nfrom benchlib.model import build_engine\n",
        "benchmarks/two_level_bench.py":
            "import checkpoint_bench as cb\n\n"
            "def main():\n    from gpu_checks.common import FAIL\n",
    })
    graph = repository_graph(str(tmp_path))
    assert graph["scripts.gpu_check"] == {"scripts.gpu_checks.common"}
    assert graph["benchmarks.checkpoint_bench"] == {"benchmarks.benchlib.model"}
    assert graph["benchmarks.benchlib.model"] == {"benchmarks.benchlib.ranks"}
    assert graph["benchmarks.two_level_bench"] == {"benchmarks.checkpoint_bench",
                                                   "scripts.gpu_checks.common"}
    assert [m for m in graph if layer_of(m, TRAINER_LAYERS) is None] == []
    assert repository_problems(graph, {}) == [
        "cycle: megatron.training.loaders, megatron.training.step",
        "upward: megatron.data.tokenizer -> megatron.training",
        "upward: megatron.model.gpt -> megatron.training.mpu",
        "program: benchmarks.two_level_bench -> scripts.gpu_checks.common"]
    assert repository_problems(graph, {
        "benchmarks.two_level_bench -> scripts.gpu_checks.common": "why",
        "megatron.training.loaders -> megatron.training.step": "why"}) == [
        "upward: megatron.data.tokenizer -> megatron.training",
        "upward: megatron.model.gpt -> megatron.training.mpu"]


def test_the_trainer_picture_draws_the_layers_this_test_enforces():
    """docs/make_architecture.py's trainer bands are these layers, in this order, it puts
    every module of the repository in the band this test does, and it reads the program
    folders this test counts as programs."""
    drawing = _import_reader()
    assert [name for name, _ in drawing.TRAINER_LAYERS] == [name for name, _ in TRAINER_LAYERS]
    assert set(drawing.PROGRAM_FOLDERS) | {"pretrain_gpt_moe"} == set(PROGRAMS)
    graph = repository_graph()
    misplaced = [(m, drawing.trainer_layer_of(m)) for m in graph
                 if layer_of(m, TRAINER_LAYERS) is None
                 or drawing.trainer_layer_of(m) != TRAINER_LAYERS[layer_of(m, TRAINER_LAYERS)][0]]
    assert misplaced == []


# ------------------------------------------------------ the library imports no megatron
# (not megatron-core either: the library runs under any DeepSpeed trainer)

TRAINER_IMPORT_EXCEPTIONS: Dict[str, str] = {}
"""Modules of ``deepspeed_ext`` (their paths) allowed to import ``megatron``, each with
its reason. A test below fails when an exception is no longer needed."""


def megatron_imports(root: str = REPO, folder: str = PACKAGE) -> List[str]:
    """``"path:line: name"`` for every name under ``megatron`` that the source files under
    ``root/folder`` import, at module level or in a function (``from x import y``
    names ``x`` and ``x.y``), whether or not the repository holds it."""
    reader = _import_reader()
    out = set()
    for module, path in reader.module_files(root, (folder,)).items():
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        for statement in reader.statements(path, module):
            out.update(f"{rel}:{statement.line}: {name}" for name in statement.dotted()
                       if name == "megatron" or name.startswith("megatron."))
    return sorted(out)


def test_the_library_imports_no_megatron():
    assert [p for p in megatron_imports()
            if p.split(":", 1)[0] not in TRAINER_IMPORT_EXCEPTIONS] == []
    assert len(_import_reader().module_files(REPO, (PACKAGE,))) > 50  # the walk saw the code


def test_every_trainer_import_exception_is_still_needed():
    """An exception whose module no longer imports the trainer is removed from the list
    (it would let a new trainer import in that module pass unseen): the modules that import
    the trainer are exactly the exceptions (today none)."""
    users = {p.split(":", 1)[0] for p in megatron_imports()}
    assert sorted(users) == sorted(TRAINER_IMPORT_EXCEPTIONS)


def test_the_library_check_finds_a_trainer_import_in_a_function_and_megatron_core(tmp_path):
    """The check can fail: a library module importing the trainer's parser inside a
    function (the old densify flag check), and one importing megatron-core, which the
    repository does not hold."""
    _write_tree(tmp_path, {
        "deepspeed_ext/cli/__init__.py": "",
        "deepspeed_ext/cli/replay.py":
            "import json\n\ndef parser():\n"
            "    from megatron.training.arguments import build_parser\n    return build_parser()\n",
        "deepspeed_ext/cli/fine.py": "from deepspeed_ext import cli\nfrom . import replay\n",
        "deepspeed_ext/groups.py": "import megatron.core.parallel_state as ps\n",
    })
    assert megatron_imports(str(tmp_path)) == [
        "deepspeed_ext/cli/replay.py:4: megatron.training.arguments",
        "deepspeed_ext/cli/replay.py:4: megatron.training.arguments.build_parser",
        "deepspeed_ext/groups.py:1: megatron.core.parallel_state",
    ]
