"""The docs say only what exists: docs/flags.md documents every flag the trainer accepts;
README.md starts with the two commands and stays short; every relative link of README.md
and docs/*.md points to a file that exists; and every command, repository path and flag
the pages name (tests/doc_commands.py reads them, and states the placeholder convention)
exists and parses, without running anything:

- a command's program is a script of the repository, one of pyproject.toml's console
  scripts, a Python file or module that exists, or a known outside tool (:data:`TOOLS`;
  ``srun CMD`` and the like check ``CMD``); a script's words fit its usage
  (:data:`SHELL_SCRIPTS`);
- its flags parse with that program's own parser: the trainer's (``parse_args``, the YAML
  configs included) for ``pretrain_gpt_moe.py``, ``moc-pretrain`` and the flags the
  launch scripts pass on; DeepSpeed's and torchrun's for the launchers, whose script is
  then checked in turn; and for any other Python program the ``argparse`` parser its
  entry point builds, caught before it parses (nothing runs);
- a trainer command whose world size the launch names (``python``: 1, ``deepspeed
  --num_gpus N``, ``torchrun --nproc-per-node N``, ``run_elastic.sh N``,
  ``launch_cluster.sh ... NODES GPUS_PER_NODE ...``) and whose flags are all shown is
  validated at that size, and has the tokenizer files its tokenizer needs;
- ``pip install -e .[extra]`` names extras pyproject.toml declares;
- every repository path a page names, in prose, code or commands (``configs/...``,
  ``scripts/...``, ``a.py:12``), exists, and every flag named in inline code is one some
  program of the repository, a launcher or a tool accepts.

Inline code may name part of a command (``moc-ckpt verify``, ``moc-plan simulate --plot``):
there a missing argument is no problem (:data:`PARTIAL`), an unknown one is. A page may
name what does not exist to say so (:data:`NAMED_AS_ABSENT`). tests/test_doc_commands.py
checks that a test runs each command.
"""

import argparse
import contextlib
import glob
import io
import os
import re
import runpy
import sys
import tomllib
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import pytest

from megatron.errors import ConfigError
from megatron.training.arguments import build_parser, parse_args, validate_args
from tests import doc_commands as docs
from tests.doc_commands import ELIDED, Step

ROOT = docs.REPO
README = os.path.join(ROOT, "README.md")
FLAGS = os.path.join(ROOT, "docs", "flags.md")
README_MAX_LINES = 260

# [text](target) and ![alt](target), the target up to a space or ")"; code spans removed first.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")

TRAINER = "pretrain_gpt_moe.py"
# Outside tools a page may run, and the flags of theirs it may name.
TOOLS = {"pip", "set", "tee", "export", "cd", "mkdir", "rm", "ls", "df", "docker", "sbatch",
         "scontrol", "head", "kubectl", "nvidia-smi", "git", "ulimit", "kill", "pgrep", "pkill",
         "cat", "grep", "id", "ss", "lsof"}
# Tools that run the command after their own -flags: that command is checked.
WRAPPERS = ("srun", "nohup", "time")
TOOL_FLAGS = {"--no-index", "--no-deps", "--target", "--no-build-isolation",
              "--system-site-packages",
              "--shm-size", "--ipc", "--ntasks-per-node", "--nodes", "--gres",
              "--durations", "--help"}
# A shell script's usage: how many positional words it takes (a range), and where the
# rest of its words go: "trainer" (pretrain_gpt_moe.py's flags), "pytest", a Python
# script of the repository whose parser takes them, or None (no more words).
SHELL_SCRIPTS = {
    "scripts/quickstart.sh": ((0, 0), None),
    "scripts/setup_env.sh": ((0, 0), None),
    "scripts/test.sh": ((0, 0), "pytest"),
    "scripts/gpu_wheels.sh": ((0, 1), None),
    "scripts/gpu_check.sh": ((0, 0), "scripts/gpu_check.py"),
    "scripts/mutation.sh": ((1, 1), "scripts/mutation.py"),
    "scripts/run_elastic.sh": ((2, 2), "trainer"),
    "scripts/launch_cluster.sh": ((6, 6), "trainer"),
    "scripts/launch_1node_dp8_ep8.sh": ((2, 3), "trainer"),
    "scripts/launch_2node_dp16_ep16.sh": ((2, 3), "trainer"),
    "scripts/launch_2node_dp16_ep8.sh": ((2, 3), "trainer"),
}
# gpu_check.sh's own flags, which it does not pass to gpu_check.py.
GPU_CHECK_SH_FLAGS = ("--reinstall", "--install-only")
EXAMPLES = "examples/megatron_deepspeed/"
OUR_PACKAGES = ("deepspeed_ext", "megatron", "tools", "benchmarks", "experiments")
# Inline code may name part of a command (a subcommand, a flag without its value): these
# errors of its parser are no problem there. A fenced block shows whole commands.
PARTIAL = ("the following arguments are required", "expected one argument",
           "expected at least one argument")
# What a page names to say that it does not exist, and why it may.
NAMED_AS_ABSENT = {
    "moc-ckpt import": "there is no such subcommand: loading a DeepSpeed checkpoint converts it",
    "megatron/__init__.py": "ours is a namespace package without one; Megatron-DeepSpeed's "
                            "has one",
}


def test_flags_page_lists_every_flag():
    text = open(FLAGS).read()
    missing = [opt for action in build_parser()._actions for opt in action.option_strings
               if opt.startswith("--") and opt != "--help" and f"`{opt}`" not in text]
    assert not missing, f"flags missing from docs/flags.md: {missing}"


def test_readme_starts_with_the_two_commands():
    head = open(README).read().split("\n## ")[0]
    assert "bash scripts/quickstart.sh" in head and "bash scripts/test.sh" in head


def test_readme_is_short():
    lines = len(open(README).read().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/")


def relative_links(path):
    """The relative link targets of a Markdown file, outside fenced code blocks and code spans."""
    targets, fenced = [], False
    for line in open(path).read().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor on the same page
            targets.append(target)
    return targets


def test_relative_links_point_to_files_that_exist():
    pages = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert len(pages) > 1, "docs/*.md not found"
    broken = []
    for page in pages:
        for target in relative_links(page):
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert not broken, f"relative links to missing files: {broken}"


# ---------------------------------------------------------------------------------------
# Parsers, caught before they parse: nothing a command names runs.

class _Caught(BaseException):
    """Raised from inside ``parse_args``: a BaseException, so that an entry point's own
    ``except Exception`` (or ``except SystemExit``) lets it through."""

    def __init__(self, parser: argparse.ArgumentParser, argv: List[str]):
        super().__init__()
        self.parser, self.argv = parser, argv


def catch_parser(entry: Callable[[], object], argv: List[str]) -> Optional[_Caught]:
    """Call ``entry`` with ``argv`` as its command line until it parses it; returns the
    parser and ``argv``, or None when it returned without parsing. A parse of other words
    on the way (a helper's ``parse_args([])``) runs as usual."""
    marker = "--moc-doc-check-marker"
    real = argparse.ArgumentParser.parse_known_args

    def caught(self, args=None, namespace=None):
        if args is None or marker in args:
            raise _Caught(self, list(argv))
        return real(self, args, namespace)
    # the entry's module-level sys.path and environment changes stay here
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", caught), \
            mock.patch.object(sys, "argv", ["prog", *argv, marker]), \
            mock.patch.object(sys, "path", list(sys.path)), mock.patch.dict(os.environ):
        try:
            entry()
        except _Caught as found:
            return found
    return None


def _console_scripts() -> Dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _extras() -> set:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"].get("optional-dependencies", {}))


def _entry_of(program: str, args: List[str]) -> Tuple[Optional[Callable], List[str], str]:
    """(a callable that runs ``program``'s entry point, its words, a problem or "")."""
    if program in ("python", "python3"):
        if args[:1] == ["-m"] and len(args) > 1:
            return (lambda: runpy.run_module(args[1], run_name="__main__")), args[2:], ""
        if not args or docs.is_placeholder(args[0]) or "PLACEHOLDER_" in args[0] \
                or args[0] == "-c":
            return None, [], ""
        path = os.path.join(ROOT, args[0])
        if not os.path.isfile(path):
            return None, [], f"no file {args[0]} in the repository"
        return (lambda: runpy.run_path(path, run_name="__main__")), args[1:], ""
    module, function = _console_scripts()[program].split(":")
    return (lambda: getattr(__import__(module, fromlist=[function]), function)()), args, ""


def _option_actions(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """Every option of ``parser`` and of its subcommands."""
    out = {}
    for action in parser._actions:
        out.update({opt: action for opt in action.option_strings})
        for sub in (getattr(action, "choices", None) or {}).values() \
                if isinstance(action, argparse._SubParsersAction) else ():
            out.update(_option_actions(sub))
    return out


def fill_elided(argv: List[str], parser: argparse.ArgumentParser) -> List[str]:
    """``...`` after a flag that takes a value stands for the value; anywhere else for
    more flags, which are left out."""
    actions, out = _option_actions(parser), []
    for word in argv:
        if word != ELIDED:
            out.append(word)
        elif out and out[-1] in actions and actions[out[-1]].nargs != 0:
            out.append("ELIDED")
    return out


def parse_quietly(parser: argparse.ArgumentParser, argv: List[str]):
    """(namespace, "") or (None, argparse's message)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(argv), ""
        except SystemExit as exit_:
            if exit_.code == 0:  # --help
                return argparse.Namespace(), ""
            return None, err.getvalue().strip().splitlines()[-1]
        except ConfigError as e:
            return None, str(e)


# ---------------------------------------------------------------------------------------
# The trainer's flags.

def _user_configs_dropped(argv: List[str]) -> Tuple[List[str], bool]:
    """``argv`` without the ``--config`` files that are the user's (placeholders, or not
    of the repository); True when one was dropped."""
    out, dropped, i = [], False, 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv) and docs.repo_path(argv[i + 1]) is None:
            dropped, i = True, i + 2
            continue
        out.append(argv[i])
        i += 1
    return out, dropped


def trainer_problems(argv: List[str], world_size: Optional[int]) -> List[str]:
    """Parse the trainer's flags as the trainer does; validate them at ``world_size`` when
    it is known and every flag is shown."""
    argv, dropped = _user_configs_dropped(argv)
    complete = ELIDED not in argv and not dropped
    argv = fill_elided(argv, build_parser())
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parse_args(argv)
        except SystemExit as exit_:  # --help
            return [] if exit_.code == 0 else [f"exit {exit_.code}"]
        except ConfigError as e:
            return [f"the trainer refuses its flags: {e}"]
    if not complete or world_size is None:
        return []
    try:
        validate_args(args, world_size)
    except ConfigError as e:
        return [f"the trainer refuses its flags on {world_size} rank(s): {e}"]
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        return ["it trains with GPT2BPETokenizer and gives no --vocab-file and --merge-file"]
    return []


def _int(word: str) -> Optional[int]:
    return int(word) if word.isdigit() else None


# ---------------------------------------------------------------------------------------
# Each kind of program.

def python_problems(program: str, args: List[str], world_size: int = 1,
                    whole: bool = True) -> List[str]:
    """A Python program (``python X.py``, ``python -m M``, a console script) and its
    words; ``whole``: they are the whole command, not a part named in prose."""
    if program == "moc-pretrain" or (program.startswith("python") and args[:1] == [TRAINER]):
        return trainer_problems(args if program == "moc-pretrain" else args[1:], world_size)
    if program.startswith("moc-") and program not in _console_scripts():
        return [f"{program} is none of pyproject.toml's console scripts"]
    if program.startswith("python") and args[:1] == ["-m"] and len(args) > 1:
        import importlib.util
        if importlib.util.find_spec(args[1]) is None:
            return [f"no module {args[1]}"]
        if args[1] == "torch.distributed.run":
            return torchrun_problems(args[2:])
        if args[1].split(".")[0] not in OUR_PACKAGES:
            return []  # another project's (python -m pytest): not ours to parse
    train_args = None
    if program == "moc-ckpt" and "--" in args:  # densify DIR --out OUT -- TRAINING FLAGS
        args, train_args = args[:args.index("--")], args[args.index("--") + 1:]
    entry, words, problem = _entry_of(program, args)
    if problem or entry is None:
        return [problem] if problem else []
    caught = catch_parser(entry, words)
    if caught is None:
        return [] if not words else [f"{program} {' '.join(args[:1])} parses no flags"]
    _, error = parse_quietly(caught.parser, fill_elided(caught.argv, caught.parser))
    if error and not whole and any(p in error for p in PARTIAL):
        error = ""
    problems = [f"its parser refuses it: {error}"] if error else []
    return problems + (trainer_problems(train_args, None) if train_args else [])


def deepspeed_problems(args: List[str]) -> List[str]:
    from deepspeed.launcher import runner
    caught = catch_parser(runner.main, args)
    ns, error = parse_quietly(caught.parser, args)
    if error:
        return [f"deepspeed refuses it: {error}"]
    # no --hostfile (DeepSpeed's default path): this machine alone
    nodes = ns.num_nodes if ns.num_nodes > 0 else 1 if ns.hostfile == "/job/hostfile" else 0
    world = ns.num_gpus * nodes if ns.num_gpus > 0 and nodes else None
    return python_problems("python", [ns.user_script, *ns.user_args], world)


def torchrun_problems(args: List[str]) -> List[str]:
    import torch.distributed.run as torchrun
    ns, error = parse_quietly(torchrun.get_args_parser(), args)
    if error:
        return [f"torchrun refuses it: {error}"]
    nproc = _int(str(ns.nproc_per_node))
    world = nproc if nproc and str(ns.nnodes) in ("1", "1:1") else None
    return python_problems("python", [ns.training_script, *ns.training_script_args], world)


def _launch_per_node(script: str, positional: List[str], flags: Sequence[str]) -> Optional[int]:
    """Training processes per node of a launch script's command (its spares left out)."""
    if script not in ("scripts/run_elastic.sh", "scripts/launch_cluster.sh"):
        return None
    per_node = _int(positional[0] if script == "scripts/run_elastic.sh" else positional[4])
    spares = (_int(flags[flags.index("--moc-spares") + 1])
              if "--moc-spares" in flags[:-1] and "in-job" in flags else 0)
    return per_node - spares if per_node and spares is not None else None


def _launch_world(script: str, positional: List[str], flags: Sequence[str] = (),
                  env: Optional[Dict[str, str]] = None) -> Optional[int]:
    per_node = _launch_per_node(script, positional, flags)
    if script == "scripts/run_elastic.sh":  # with --moc-restart in-job, less the spares
        nodes = _int((env or {}).get("NNODES", "1"))
        spare_nodes = _int((env or {}).get("SPARE_NODES", "0"))  # they train nothing
        nodes = nodes - spare_nodes if nodes is not None and spare_nodes is not None else None
        return per_node * nodes if per_node and nodes else None
    if script == "scripts/launch_cluster.sh":  # NODES training nodes (SPARE_NODES besides)
        nodes = _int(positional[3])
        return nodes * per_node if nodes and per_node else None
    return None  # the fixed layouts: tests/test_doc_commands.py launches them


@contextlib.contextmanager
def _under_supervisor(yes: bool, per_node: Optional[int] = None):
    """The environment MoC's supervisor gives the trainer (``run_elastic.sh`` starts it
    for ``--moc-restart in-job``): the store's address and, when known, its training
    processes per node (``LOCAL_WORLD_SIZE``), while a launch's flags are checked."""
    from deepspeed_ext.runtime.rounds import STORE_ENV
    given = {STORE_ENV: "127.0.0.1:29500"} if yes else {}
    if yes and per_node:
        given["LOCAL_WORLD_SIZE"] = str(per_node)
    old = {key: os.environ.get(key) for key in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _launch_argv(script: str, positional: List[str], flags: List[str]) -> List[str]:
    """The trainer's flags a launch script passes on (the launch's own added where the
    script names them: config, data and expert-parallel size of launch_cluster.sh)."""
    if script != "scripts/launch_cluster.sh":
        return flags
    named = [("--config", positional[2]), ("--data-path", positional[1]),
             ("--moe-expert-parallel-size", positional[5])]
    return [w for flag, value in named if not docs.is_placeholder(value)
            for w in (flag, value)] + flags


def shell_problems(args: List[str], env: Optional[Dict[str, str]] = None) -> List[str]:
    """``bash SCRIPT words`` / ``source SCRIPT``, run with the assignments ``env`` before
    it (``NNODES=2 bash scripts/run_elastic.sh ...``)."""
    script = args[0] if args else ""
    if docs.repo_path(script) is None:
        return []  # the user's (source .venv/bin/activate)
    if not os.path.isfile(os.path.join(ROOT, script)):
        return [f"no script {script}"]
    if script.startswith(EXAMPLES):
        return [] if len(args) == 1 else [f"{script} takes its settings from the environment"]
    if script not in SHELL_SCRIPTS:
        return [f"{script}: its usage is not in SHELL_SCRIPTS of tests/test_readme.py"]
    (least, most), rest = SHELL_SCRIPTS[script]
    words = args[1:]
    if ELIDED in words:
        return []  # its words are the user's (MAX_RESTARTS=N bash launch_cluster.sh ...)
    count = 0
    while count < min(most, len(words)) and not words[count].startswith("-"):
        count += 1
    positional, flags = words[:count], words[count:]
    if count < least or (flags and rest is None):
        return [f"{script} takes {least}-{most} positional words and "
                f"{'flags' if rest else 'no flags'}: got {' '.join(words)}"]
    if rest == "trainer":
        with _under_supervisor("in-job" in flags, _launch_per_node(script, positional, flags)):
            return trainer_problems(_launch_argv(script, positional, flags),
                                    _launch_world(script, positional, flags, env))
    if rest == "scripts/gpu_check.py":
        flags = [f for f in flags if f not in GPU_CHECK_SH_FLAGS]
        return python_problems("python", [rest, *flags])
    return []


def pip_problems(args: List[str]) -> List[str]:
    known = _extras()
    wanted = [e for word in args for group in re.findall(r"^\.\[([^\]]+)\]$", word)
              for e in group.split(",")]
    return [f"pyproject.toml has no extra [{e}]" for e in wanted if e not in known]


def step_problems(step: Step, whole: bool = True) -> List[str]:
    program, args = step.program, step.args
    if program in ("bash", "sh", "source", "."):
        return shell_problems(args, step.env)
    if program in ("python", "python3") or program.startswith("moc-"):
        return python_problems(program, args, whole=whole)
    if program == "deepspeed":
        return deepspeed_problems(args)
    if program == "torchrun":
        return torchrun_problems(args)
    if program == "pip":
        return pip_problems(args)
    if program in WRAPPERS:
        rest = list(args)
        while rest and rest[0].startswith("-"):
            rest.pop(0)
        return step_problems(Step(rest[0], rest[1:]), whole) if rest else []
    if program in TOOLS or docs.is_placeholder(program):
        return []
    return [f"unknown program {program} (add it to TOOLS in tests/test_readme.py if it is "
            "an outside tool)"]


def command_problems(command: docs.Command, whole: Optional[bool] = None) -> List[str]:
    """What is wrong with ``command``, each naming where it is; ``whole`` (default: a
    fenced one is) holds it to be the whole command."""
    if command.text in NAMED_AS_ABSENT:
        return []
    whole = command.fenced if whole is None else whole
    return [f"{command.where()}\n    {p}" for step in docs.steps(command.text)
            for p in step_problems(step, whole)]


def test_every_command_the_docs_show_parses():
    """Each command of README.md, docs/*.md and benchmarks/README.md: its program exists
    and its words parse with that program's parser (see the module's docstring)."""
    found = docs.commands()
    assert len({c.page for c in found}) > 10, "the pages' commands were not found"
    problems = [p for command in found for p in command_problems(command)]
    assert not problems, "commands the docs show that fail:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------
# Paths and flags named anywhere.

def test_every_repository_path_the_docs_name_exists():
    missing, named = [], 0
    for page in docs.doc_pages():
        for number, path in docs.named_paths(page):
            named += 1
            if not os.path.exists(os.path.join(ROOT, path)) and path not in NAMED_AS_ABSENT:
                missing.append(f"{page}:{number}: {path}")
    assert named > 100, "the pages' paths were not found"
    assert not missing, "paths of the repository the docs name that do not exist:\n" + \
        "\n".join(sorted(set(missing)))


def known_flags() -> set:
    """The flags of every program of the repository, the launchers' and the tools'."""
    import torch.distributed.run as torchrun
    from deepspeed.launcher import runner
    flags = set(TOOL_FLAGS) | set(_option_actions(build_parser()))
    flags |= set(_option_actions(torchrun.get_args_parser()))
    flags |= set(_option_actions(catch_parser(runner.main, []).parser))
    flags |= set(GPU_CHECK_SH_FLAGS)
    from deepspeed_ext.supervisor.options import build_parser as supervisor_parser
    flags |= set(_option_actions(supervisor_parser()))  # python -m deepspeed_ext.supervisor
    for program in _console_scripts():
        if program != "moc-pretrain":
            flags |= set(_option_actions(catch_parser(_entry_of(program, [])[0], []).parser))
    for path in sorted(glob.glob(os.path.join(ROOT, "*", "*.py"))):
        rel = os.path.relpath(path, ROOT)
        if rel.split("/")[0] in ("benchmarks", "experiments", "scripts", "tools", "docs") \
                and '__name__ == "__main__"' in open(path, encoding="utf-8").read():
            entry, _, _ = _entry_of("python", [rel])
            caught = catch_parser(entry, ["--help"]) if entry else None
            flags |= set(_option_actions(caught.parser)) if caught else set()
    return flags


def test_every_flag_the_docs_name_exists():
    """A flag in inline code (``--moc-two-level``, ``--moe-schedule auto``) is one that
    some program of the repository, DeepSpeed's launcher, torchrun or a tool takes."""
    known = known_flags()
    assert {"--moc-two-level", "--num_gpus", "--out", "--json-keys"} <= known
    assert "--no-such-flag" not in known
    unknown = []
    for page in docs.doc_pages():
        for number, span in docs.code_spans(page):
            flag = re.match(r"^(--[A-Za-z0-9][A-Za-z0-9_-]*)", span)
            if flag and flag.group(1) not in known:
                unknown.append(f"{page}:{number}: {flag.group(1)}")
    assert not unknown, "flags the docs name that no program takes:\n" + "\n".join(unknown)


@pytest.mark.parametrize("text, needle", [
    ("bash scripts/launch_cluster.sh hostfile d configs/gpt-125m-8e.yaml 1 8 8",
     "GPT2BPETokenizer and gives no --vocab-file"),
    ("python pretrain_gpt_moe.py --config configs/tiny.yaml --data-path d --no-such-flag",
     "unrecognized arguments: --no-such-flag"),
    ("torchrun --nproc-per-node 3 pretrain_gpt_moe.py --config configs/tiny.yaml --data-path d",
     "on 3 rank(s)"),
    ("deepspeed --num_gpus 3 pretrain_gpt_moe.py --config configs/small.yaml --data-path d",
     "on 3 rank(s)"),
    ("moc-plan simulate --config configs/tiny.yaml --gpus many", "invalid int value"),
    ("moc-ckpt verify", "the following arguments are required: dir"),
    ("python benchmarks/checkpoint_bench.py --tp", "expected one argument"),
    ("bash scripts/run_elastic.sh 2", "takes 2-2 positional words"),
    ("bash scripts/nope.sh", "no script scripts/nope.sh"),
    ("pip install -e .[gpus]", "no extra [gpus]"),
    ("moc-nope x", "none of pyproject.toml's console scripts"),
    ("frobnicate --all", "unknown program frobnicate"),
    ("srun --nodes=2 bash scripts/nope.sh", "no script scripts/nope.sh"),
    ("python -m deepspeed_ext.nope", "no module deepspeed_ext.nope"),
])
def test_the_checker_finds_each_kind_of_problem(text, needle):
    problems = command_problems(docs.Command("x.md", 1, text, fenced=True))
    assert any(needle in p for p in problems), problems
