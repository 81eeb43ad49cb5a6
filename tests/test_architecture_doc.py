"""``docs/architecture.md`` and its pictures stay true to the repository.

The pictures (the library's layers, the trainer's) are generated from the imports
(``docs/make_architecture.py``) and committed; a module moved, added or importing
something new without the pictures being redrawn fails here, and so does a module or
function named in the page that no longer exists.
"""

import ast
import importlib.util
import os
import re
from typing import Dict, Optional, Set

from tests.launch import REPO

DOCS = os.path.join(REPO, "docs")
PACKAGE = "deepspeed_ext"


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "make_architecture", os.path.join(DOCS, "make_architecture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_picture_is_what_the_script_draws_now(tmp_path):
    """Both pictures: the library's layers and the trainer's."""
    script = _load_script()
    outs = {"architecture.svg": tmp_path / "architecture.svg",
            "architecture-trainer.svg": tmp_path / "architecture-trainer.svg"}
    assert script.main(["--out", str(outs["architecture.svg"]),
                        "--trainer-out", str(outs["architecture-trainer.svg"])]) == 0
    for name, out in outs.items():
        with open(os.path.join(DOCS, name), encoding="utf-8") as f:
            committed = f.read()
        assert out.read_text(encoding="utf-8") == committed, (
            f"docs/{name} is stale: run `python docs/make_architecture.py` and commit it")


def test_the_picture_names_every_module_and_files_unknown_ones_as_unsorted(tmp_path):
    """The drawing follows the tree: a new top-level module nobody mapped yet is drawn in
    the ``unsorted`` band, an import across layers becomes an arrow with its count."""
    script = _load_script()
    pkg = tmp_path / PACKAGE
    for sub in ("", "format", "store"):
        (pkg / sub).mkdir(exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "store" / "commit.py").write_text(
        "from deepspeed_ext.format import manifest\n"
        "def f():\n    from deepspeed_ext.format import fs\n")
    (pkg / "format" / "manifest.py").write_text("")
    (pkg / "format" / "fs.py").write_text("")
    (pkg / "brand_new.py").write_text("import deepspeed_ext.store.commit\n")
    modules, edges = script.import_edges(str(tmp_path))
    assert script.layer_of("deepspeed_ext.brand_new") == "unsorted"
    assert [tuple(c) for c in script.crossings(edges)] == [
        ("store", "format", 2, 1), ("unsorted", "store", 1, 0)]
    svg = script.render(modules, edges)
    assert ">brand_new<" in svg and ">store/commit<" in svg and ">unsorted (1)<" in svg
    assert ">2<" in svg and ">1fn<" in svg


def test_the_trainer_picture_groups_programs_by_folder_and_draws_an_upward_import_red(
        tmp_path):
    """The trainer's picture: the library as one box per library layer, a program folder's
    modules as one group (read with the folder on ``sys.path``), a new ``megatron``
    subpackage in ``unsorted``, and a model module importing training as a red arrow."""
    script = _load_script()
    files = {
        "deepspeed_ext/__init__.py": "", "deepspeed_ext/store/__init__.py": "",
        "deepspeed_ext/store/commit.py": "",
        "megatron/errors.py": "", "megatron/training/__init__.py": "",
        "megatron/training/args/__init__.py": "", "megatron/training/args/checks.py": "",
        "megatron/training/step.py": "from megatron.errors import ConfigError\n"
                                     "from deepspeed_ext.store import commit\n",
        "megatron/model/__init__.py": "",
        "megatron/model/gpt.py": "def f():\n    from megatron.training import step\n",
        "megatron/brand_new/__init__.py": "",
        "benchmarks/benchlib/__init__.py": "", "benchmarks/benchlib/ranks.py": "",
        "benchmarks/checkpoint_bench.py": "from benchlib.ranks import REPO\n"
                                          "import megatron.training.step\n",
        "pretrain_gpt_moe.py": "from megatron.training.step import train_step\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules, edges = script.import_edges(str(tmp_path), script.REPOSITORY)
    assert script.trainer_layer_of("megatron.brand_new") == "unsorted"
    assert [tuple(c) for c in script.crossings(edges, script.trainer_layer_of)] == [
        ("model", "training", 1, 1), ("programs", "training", 2, 0),
        ("training", "base", 1, 0), ("training", "library", 1, 0)]
    svg = script.render_trainer(modules, edges)
    for text in ("store (2)", "facade (1)", "benchmarks/ (3)", "benchlib/ranks",
                 "checkpoint_bench", "pretrain_gpt_moe", "args/ (2)", "checks", "step",
                 "unsorted (1)", "megatron/brand_new"):
        assert f">{text}<" in svg, text
    assert svg.count("stroke='#c00'") == 2  # the upward arrow and its label's frame


# names in the page ---------------------------------------------------------------------

def _module_files() -> Dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, PACKAGE)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), REPO)[:-3].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(dirpath, name)
    return out


def _defined(tree: ast.AST) -> Dict[str, Optional[ast.AST]]:
    """Names bound at the top of ``tree`` (a module or class body) -> class node or None."""
    out: Dict[str, Optional[ast.AST]] = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Name):
                    out[target.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = None
    return out


def dotted_problem(token: str, files: Dict[str, str]) -> Optional[str]:
    """Why ``token`` (``store.commit.commit_checkpoint``, relative to the package or
    absolute) names nothing; None when it names a module, or a name defined in one."""
    parts = token.split(".")
    if parts[0] != PACKAGE and os.path.isdir(os.path.join(REPO, parts[0])):
        # another package of the repository (`megatron.training`): its module must exist
        path = os.path.join(REPO, *parts)
        return None if os.path.isdir(path) or os.path.isfile(path + ".py") else \
            f"`{token}`: no module {token}"
    if parts[0] != PACKAGE:
        parts = [PACKAGE] + parts
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        if module in files:
            break
    else:
        return f"`{token}`: no module {'.'.join(parts[:2])}"
    with open(files[module], encoding="utf-8") as f:
        scope: Optional[ast.AST] = ast.parse(f.read())
    for name in parts[cut:]:
        names = _defined(scope) if scope is not None else {}
        if name not in names:
            return f"`{token}`: {module} defines no {name}"
        scope = names[name]
    return None


BACKTICKED = re.compile(r"`([^`\s]+)`")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def page_problems(text: str, files: Dict[str, str]) -> Set[str]:
    """Backticked paths of the page that name nothing: dotted module paths (relative to
    ``deepspeed_ext`` or starting with it) and repository file paths (with a ``/``, or a
    ``.py`` file at the root)."""
    problems = set()
    for token in BACKTICKED.findall(text):
        if "/" in token or token.endswith(".py"):
            if not os.path.exists(os.path.join(REPO, token.rstrip("/"))):
                problems.add(f"`{token}`: no such path")
        elif DOTTED.match(token):
            problem = dotted_problem(token, files)
            if problem:
                problems.add(problem)
    return problems


def test_every_module_and_name_in_the_page_exists():
    with open(os.path.join(DOCS, "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    files = _module_files()
    assert len(BACKTICKED.findall(text)) > 20  # the page names its modules
    assert sorted(page_problems(text, files)) == []


def test_the_name_check_can_fail():
    files = _module_files()
    assert page_problems("`store.commit.commit_checkpoint` `store/`", files) == {
        "`store/`: no such path"}
    assert page_problems("`store.commit.no_such_function`, `nowhere.thing`, `docs/none.py`, "
                         "`megatron.nowhere`, `nowhere.py`, `pretrain_gpt_moe.py`",
                         files) == {
        "`nowhere.py`: no such path",
        "`store.commit.no_such_function`: deepspeed_ext.store.commit defines no no_such_function",
        "`nowhere.thing`: no module deepspeed_ext.nowhere",
        "`docs/none.py`: no such path", "`megatron.nowhere`: no module megatron.nowhere"}
