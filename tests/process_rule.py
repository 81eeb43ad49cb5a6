"""The ``e2e`` rule: which tests start processes, decided from the source alone
(:func:`e2e_reason`; used by tests/conftest.py at collection).

**The e2e rule.** A test is end-to-end (marked ``e2e``, registered in pytest.ini) when it
starts a process: ``bash scripts/test.sh --fast`` runs the others (``-m "not e2e"``). The
mark is given at collection (:func:`pytest_collection_modifyitems`, before ``-m``
deselects), from the source alone, by :func:`e2e_reason`; nothing is run to decide it:

1. A test *starts processes* when its function body refers to something that does, or when
   one of its fixtures (pytest's closure, ``item.fixturenames``: requested, autouse and
   fixtures of fixtures, found as pytest finds them: class, module, then each conftest.py
   up to ``tests/``) is a function whose body does.
2. Something *does* when it is a process primitive (:data:`PRIMITIVES`: ``subprocess``'s
   functions, ``os.fork``/``system``/``popen``/``spawn*``/``posix_spawn``, ``pty``,
   ``multiprocessing``'s and ``torch.multiprocessing``'s processes and pools, torchrun's
   and elastic's launchers, ``ProcessPoolExecutor``, ``asyncio``'s subprocesses), or a
   function of this repository whose body reaches one, followed through the modules'
   imports (a function's own imports and package re-exports included). So
   ``tests.launch.run_ranks`` and ``fresh_python``, ``tests.deepspeed_ext.two_level_runs.run``,
   ``tests.other_user.run_as_other_user``, a test module's own ``_elastic`` helper and
   ``deepspeed_ext.keeper.ensure_keeper`` (it spawns the keeper) all count, with no list
   of helpers to keep up to date.
3. In test code (``tests/``) any reference counts (a helper passed as a thread's target);
   in the library only a call does: a dispatch table naming every subcommand
   (``{"calibrate": cmd_calibrate}``) does not make each caller of ``main`` start what
   one subcommand starts.
4. A class counts by its constructor, or by any method when it is a test helper; a method
   reached through an instance (``obj.method()``) cannot be resolved without types and is
   not followed; nor are decorators and default arguments (they run at collection).

The rule is per test, not per module: a module with multi-rank jobs keeps its pure tests
in the fast subset. A test may also carry ``@pytest.mark.e2e`` itself. What the static
rule cannot see (rule 4's instance methods, a library's own processes) the guard finds: in
a session whose tests are all unmarked (``--fast``, or a pure file alone), an audit hook
(:class:`ProcessGuard`) fails any test that starts a process, naming the process and the
line of the repository that started it.
"""

import ast
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRIMITIVES = (
    "subprocess.Popen", "subprocess.run", "subprocess.call", "subprocess.check_call",
    "subprocess.check_output", "subprocess.getoutput", "subprocess.getstatusoutput",
    "os.fork", "os.forkpty", "os.system", "os.popen", "os.posix_spawn", "os.posix_spawnp",
    "os.spawnl", "os.spawnle", "os.spawnlp", "os.spawnlpe", "os.spawnv", "os.spawnve",
    "os.spawnvp", "os.spawnvpe", "pty.fork", "pty.spawn",
    "multiprocessing.Process", "multiprocessing.Pool", "multiprocessing.Manager",
    "multiprocessing.get_context", "multiprocessing.pool.Pool",
    "torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
    "torch.multiprocessing.Process", "torch.multiprocessing.Pool",
    "torch.multiprocessing.get_context", "torch.distributed.run.main", "torch.distributed.run.run",
    "torch.distributed.launcher.api", "torch.distributed.launcher.elastic_launch",
    "torch.distributed.launcher.launch_agent", "torch.distributed.elastic.multiprocessing",
    "concurrent.futures.ProcessPoolExecutor", "concurrent.futures.process",
    "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell",
)
"""Names that start a process, and modules whose every name does: a reference to one of
these, or to an attribute of it (``subprocess.run``, ``multiprocessing.pool.Pool``)."""

CONSTRUCTORS = ("__init__", "__post_init__", "__new__")
FIXTURE_DECORATORS = ("pytest.fixture", "fixture")


def is_primitive(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PRIMITIVES)


@dataclass
class Module:
    """One parsed module of the repository: its top-level functions and classes, and the
    names its imports bind (``{local name: dotted target}``)."""
    name: str
    path: str
    tree: ast.Module
    defs: Dict[str, ast.AST] = field(default_factory=dict)
    aliases: Dict[str, str] = field(default_factory=dict)


def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(os.path.abspath(path), root)[:-len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _is_test_code(mod: Module) -> bool:
    return mod.name.split(".")[0] == "tests"


def import_aliases(nodes: Iterable[ast.AST], module: str, package: bool) -> Dict[str, str]:
    """``{local name: dotted target}`` for the import statements among ``nodes`` of
    ``module`` (``package``: it is an ``__init__``, for relative imports)."""
    out = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                    a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts[:len(parts) - node.level + (1 if package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                if a.name != "*":
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


class CodeIndex:
    """The repository's modules, parsed on first use, and which of their functions start
    processes (:meth:`starts`, memoized). One per test session; every call is on the main
    thread, at collection."""

    def __init__(self, root: str = REPO):
        self.root = root
        self._modules: Dict[str, Optional[Module]] = {}
        self._memo: Dict[Tuple[str, int], Optional[str]] = {}
        self._fixtures: Dict[Tuple[str, int], Dict[str, ast.AST]] = {}
        self._open: set = set()  # functions being read (a recursion stops at them)
        self._cut = False  # whether the function being read met one of them

    def module(self, name: str) -> Optional[Module]:
        """The repository's module ``name`` (dotted), or None if it is not ours."""
        if name not in self._modules:
            self._modules[name] = None
            base = os.path.join(self.root, *name.split("."))
            for path in (base + ".py", os.path.join(base, "__init__.py")):
                if name and os.path.isfile(path):
                    self._modules[name] = self._parse(path)
                    break
        return self._modules[name]

    def module_at(self, path: str) -> Optional[Module]:
        return self.module(_module_name(path, self.root))

    def fixtures(self, mod: Module, cls: Optional[ast.ClassDef] = None) -> Dict[str, ast.AST]:
        """``{fixture name: its function}`` defined in ``mod``'s body, or in ``cls``'s."""
        key = (mod.path, cls.lineno if cls else 0)
        if key not in self._fixtures:
            body = cls.body if cls else mod.tree.body
            self._fixtures[key] = {fixture_name(n): n for n in body if fixture_name(n)}
        return self._fixtures[key]

    def _parse(self, path: str) -> Module:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        name = _module_name(path, self.root)
        mod = Module(name, path, tree)
        top = list(tree.body)
        for node in tree.body:  # imports under `try:`/`if TYPE_CHECKING:` bind names too
            if isinstance(node, (ast.Try, ast.If)):
                top += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
        mod.aliases = import_aliases(top, name, path.endswith("__init__.py"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                mod.defs[node.name] = node
        return mod

    def starts(self, dotted: str, depth: int = 0) -> Optional[str]:
        """Why referring to ``dotted`` (a fully qualified name) starts a process, as the
        chain of names down to a primitive; None when it does not (or is not ours)."""
        if is_primitive(dotted):
            return dotted
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            mod = self.module(".".join(parts[:i]))
            if mod is not None:
                return self._starts_in(mod, parts[i:], depth) if depth < 50 else None
        return None

    def _starts_in(self, mod: Module, attrs: List[str], depth: int) -> Optional[str]:
        if not attrs:
            return None  # the module itself, passed around: not a call
        first, rest = attrs[0], attrs[1:]
        if first in mod.aliases:  # a re-export: follow it
            return self.starts(".".join([mod.aliases[first], *rest]), depth + 1)
        node = mod.defs.get(first)
        if isinstance(node, ast.ClassDef):
            return self._class_starts(mod, node, rest[:1])
        if node is not None:
            return self.function_starts(mod, node)
        return None

    def _class_starts(self, mod: Module, cls: ast.ClassDef, attr: List[str]) -> Optional[str]:
        helper = _is_test_code(mod)
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    node.name in attr or (not attr and (helper or node.name in CONSTRUCTORS))):
                why = self.function_starts(mod, node, cls)
                if why:
                    return why
        return None

    def function_starts(self, mod: Module, node: ast.AST,
                        cls: Optional[ast.ClassDef] = None) -> Optional[str]:
        """Why the body of function ``node`` (of ``mod``, a method of ``cls``) starts a
        process: ``"mod.func -> name -> ... -> primitive"``, or None."""
        key = (mod.path, node.lineno)
        if key in self._memo:
            return self._memo[key]
        if key in self._open:  # a recursion back into a function still being read
            self._cut = True
            return None
        self._open.add(key)
        outer_cut, self._cut = self._cut, False
        own = f"{mod.name}.{cls.name + '.' if cls else ''}{node.name}"
        local = import_aliases(ast.walk(node), mod.name, mod.path.endswith("__init__.py"))
        why = None
        for dotted in referenced_names(node, calls_only=not _is_test_code(mod)):
            target = resolve(mod, local, cls, dotted)
            why = target and self.starts(target)
            if why:
                why = f"{own} -> {why}"
                break
        self._open.discard(key)
        # A "no" that relied on a function of the cycle still open may be wrong (that
        # function can start a process further on): kept only once the cycle is read.
        if why or not self._cut or not self._open:
            self._memo[key] = why
        self._cut = outer_cut or self._cut
        return why


def referenced_names(func: ast.AST, calls_only: bool = False) -> Iterator[str]:
    """Every dotted name (``a``, ``a.b.c``) the body of ``func`` loads, in source order, or
    with ``calls_only`` every name it calls (``a.b.c(...)``, not ``{"x": a.b.c}``); its
    decorators and default arguments are left out (they run at definition)."""
    for stmt in func.body:
        for node in ast.walk(stmt):
            if calls_only:
                if not isinstance(node, ast.Call):
                    continue
                node = node.func
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                parts, inner = [node.attr], node.value
                while isinstance(inner, ast.Attribute):
                    parts.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name):
                    yield ".".join([inner.id, *reversed(parts)])
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                yield node.id


def resolve(mod: Module, local: Dict[str, str], cls: Optional[ast.ClassDef],
            dotted: str) -> Optional[str]:
    """The fully qualified name ``dotted`` stands for in ``mod`` (``local``: the function's
    own imports; ``self.x``/``cls.x`` in a method of ``cls``), or None for a local variable
    or a builtin."""
    root, _, rest = dotted.partition(".")
    tail = "." + rest if rest else ""
    if root in local:
        return local[root] + tail
    if cls is not None and root in ("self", "cls") and rest:
        return f"{mod.name}.{cls.name}.{rest.split('.')[0]}"
    if root in mod.defs:
        return f"{mod.name}.{dotted}"
    if root in mod.aliases:
        return mod.aliases[root] + tail
    return None  # a local variable, a parameter or a builtin


# ---------------------------------------------------------------------------------------
# The e2e rule: tests and their fixtures.

def fixture_name(node: ast.AST) -> Optional[str]:
    """The name ``node`` is a fixture under (``@pytest.fixture(name=...)`` too), or None."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for dec in node.decorator_list:
        call = dec if isinstance(dec, ast.Call) else None
        target = ast.unparse(call.func if call else dec)
        if target in FIXTURE_DECORATORS:
            for kw in (call.keywords if call else []):
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
            return node.name
    return None


def fixture_defs(index: CodeIndex, test_path: str, name: str, cls_name: Optional[str] = None
                 ) -> Optional[Tuple[Module, ast.AST, Optional[ast.ClassDef]]]:
    """Where pytest finds fixture ``name`` for a test of ``test_path`` (in class
    ``cls_name``): the class, the module, then each conftest.py up to ``tests/``; None for
    pytest's own fixtures and plugins'."""
    places = [test_path]
    tests_dir = os.path.join(index.root, "tests")
    directory = os.path.dirname(os.path.abspath(test_path))
    while directory == tests_dir or directory.startswith(tests_dir + os.sep):
        places.append(os.path.join(directory, "conftest.py"))
        directory = os.path.dirname(directory)
    for i, path in enumerate(places):
        mod = index.module_at(path) if os.path.isfile(path) else None
        if mod is None:
            continue
        cls = mod.defs.get(cls_name) if i == 0 and cls_name else None
        owners = [cls, None] if isinstance(cls, ast.ClassDef) else [None]
        for owner in owners:
            node = index.fixtures(mod, owner).get(name)
            if node is not None:
                return mod, node, owner
    return None


def e2e_reason(index: CodeIndex, test_path: str, qualname: str,
               fixturenames: Iterable[str]) -> Optional[str]:
    """Why the test ``qualname`` (``test_x`` or ``TestY.test_x``) of ``test_path``, with
    the fixtures ``fixturenames``, starts a process (the rule in this module's docstring),
    or None. A test the source does not show (made by a generator) counts as the module:
    any function of it that starts a process marks it."""
    mod = index.module_at(test_path)
    if mod is None:
        return None
    cls_name, _, name = qualname.rpartition(".")
    owner = mod.defs.get(cls_name) if cls_name else None
    scope = owner.body if isinstance(owner, ast.ClassDef) else mod.tree.body
    node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name), None)
    if node is None:
        return next(filter(None, (index.function_starts(mod, n) for n in mod.defs.values()
                                  if not isinstance(n, ast.ClassDef))), None)
    why = index.function_starts(mod, node, owner if isinstance(owner, ast.ClassDef) else None)
    for fixture in fixturenames:
        if why:
            break
        found = fixture_defs(index, test_path, fixture, cls_name or None)
        if found:
            fmod, fnode, fcls = found
            why = index.function_starts(fmod, fnode, fcls)
            why = why and f"fixture {fixture}: {why}"
    return why


def static_fixturenames(index: CodeIndex, test_path: str, qualname: str) -> List[str]:
    """The fixtures a test requests by its parameters, and theirs, read from the source
    (pytest's ``item.fixturenames`` without collecting; no autouse, no ``usefixtures``)."""
    mod = index.module_at(test_path)
    cls_name, _, name = qualname.rpartition(".")
    owner = mod.defs.get(cls_name) if cls_name else None
    scope = owner.body if isinstance(owner, ast.ClassDef) else mod.tree.body
    todo = [next(n for n in scope if getattr(n, "name", None) == name)]
    seen: List[str] = []
    while todo:
        for arg in todo.pop().args.args:
            if arg.arg not in seen and arg.arg not in ("self", "cls", "request"):
                seen.append(arg.arg)
                found = fixture_defs(index, test_path, arg.arg, cls_name or None)
                if found:
                    todo.append(found[1])
    return seen


def item_reason(index: CodeIndex, item) -> Optional[str]:
    function = getattr(item, "function", None)
    if function is None:  # not a Python test function (a doctest, a plugin's item)
        return None
    return e2e_reason(index, str(item.path), function.__qualname__, item.fixturenames)


@dataclass
class RuleState:
    """What collection left for tests/test_markers.py: the index the marks came from
    (its memo makes checking them cheap), and the tests ``-m``/``-k`` deselected."""
    index: Optional[CodeIndex] = None
    deselected: list = field(default_factory=list)


RULE = RuleState()
