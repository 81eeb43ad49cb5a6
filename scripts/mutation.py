"""Mutation testing of one package of ours with cosmic-ray: how many mutants its tests kill.

Run by ``bash scripts/mutation.sh PACKAGE [flags]``, which installs the cosmic-ray that
pyproject.toml's ``[mutation]`` extra pins and then runs this file; not part of CI. One
process, one mutant at a time, in this order:

1. copy the working tree (git's tracked files and its untracked files that are not
   ignored) to a temporary folder: mutants are written into files there, never into the
   checkout, where other runs of the tests would import them;
2. run the package's tests once on the unmutated copy (the baseline): they must pass, and
   their time sets each mutant's timeout;
3. list every mutant of the package's modules (cosmic-ray's core operators: arithmetic,
   comparison, boolean and unary operators swapped, numbers moved by one, ``break`` and
   ``continue`` swapped, loops run zero times, decorators and exceptions replaced) in a
   stable order; with ``--sample N``, draw N of them with ``random.Random(--seed)``;
4. for each: write it into the copy, run the tests (``python -m pytest -x``, plus
   ``--pytest-args``: ``-m "not e2e"`` leaves out the tests that start processes) in a new
   process, put the file back (cosmic-ray's ``mutate_and_test``); a test failing or the
   run passing the timeout kills the mutant, all tests passing means it survived;
5. print the kill rate and each survivor (file:line, the operator, the line before and
   after) and write them, with every mutant's outcome, to ``--json``.

The tests are the package's mirror under ``tests/`` (``deepspeed_ext/policy`` ->
``tests/deepspeed_ext/policy``) unless ``--tests`` names others. The copy goes first on
``PYTHONPATH``, so the processes a test starts import the mutant too.
"""

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Left out of a copy made without git: environments, outputs and caches, never sources.
NOT_COPIED = (".git", ".venv", "__pycache__", ".pytest_cache", "*.egg-info", "build", "dist",
              "runs", "data", "checkpoints", ".gpu_wheels")


@dataclass
class Mutant:
    """One mutant and what the tests made of it."""

    file: str
    """Module path relative to the repository root."""
    line: int
    """1-based line where the mutation starts."""
    col: int
    operator: str
    """cosmic-ray's operator name without its provider (``ReplaceComparisonOperator_Lt_LtE``)."""
    occurrence: int
    """Index of this operator's mutation in the file (cosmic-ray's ``occurrence``)."""
    outcome: str = "pending"
    """``killed``, ``timeout`` (killed by the time limit), ``survived`` or ``incompetent``
    (the mutation could not be made or run; counted apart)."""
    seconds: float = 0.0
    diff: List[str] = field(default_factory=list)
    """The changed lines: ``-`` before, ``+`` after."""


@dataclass
class Report:
    """What one run found; written as JSON after every mutant (an interrupted run keeps
    what it did)."""

    tool: str
    command: str
    commit: str
    package: str
    tests: List[str]
    seed: int
    sample: Optional[int]
    mutants_total: int
    baseline_s: float
    timeout_s: float
    mutants: List[Mutant] = field(default_factory=list)
    elapsed_s: float = 0.0

    def count(self, *outcomes: str) -> int:
        return sum(m.outcome in outcomes for m in self.mutants)

    def kill_rate(self) -> Optional[float]:
        killed, survived = self.count("killed", "timeout"), self.count("survived")
        return killed / (killed + survived) if killed + survived else None

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(mutants_run=self.count("killed", "timeout", "survived", "incompetent"),
                   killed=self.count("killed", "timeout"), timeouts=self.count("timeout"),
                   survived=self.count("survived"), incompetent=self.count("incompetent"),
                   kill_rate=self.kill_rate(),
                   survivors=[asdict(m) for m in self.mutants if m.outcome == "survived"])
        return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bash scripts/mutation.sh",
        description="Mutate a package of ours (cosmic-ray) and run its own tests on each "
                    "mutant; print the kill rate and the survivors, and write them to JSON.")
    parser.add_argument("package", help="package folder or module, relative to the "
                        "repository root (deepspeed_ext/policy, megatron/training/arguments.py)")
    parser.add_argument("--tests", action="append", default=None, metavar="PATH",
                        help="test file or folder to run on each mutant (repeatable); "
                        "default: the package's mirror under tests/")
    parser.add_argument("--pytest-args", default="", metavar="ARGS",
                        help="more pytest arguments for every run, one shell-quoted string "
                        "(--pytest-args='-m \"not e2e\"': leave out tests that start "
                        "processes)")
    parser.add_argument("--sample", type=int, default=None, metavar="N",
                        help="run N mutants drawn at random (seeded) instead of all")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="seconds per mutant before it counts as killed "
                        "(default: 5 x the baseline, at least 30)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="report file (default runs/mutation/PACKAGE[-sampleN-seedS].json)")
    parser.add_argument("--fail-under", type=float, default=None, metavar="PCT",
                        help="exit 1 when the kill rate is below PCT percent")
    parser.add_argument("--survivors-of", default=None, metavar="REPORT",
                        help="run only the mutants that survived in an earlier report of "
                        "the same code (after adding tests: which survivors they kill)")
    parser.add_argument("--count-only", action="store_true",
                        help="list the mutants, print how many, run nothing")
    return parser


def default_tests(package: str) -> List[str]:
    """The package's mirror under tests/: ``a/b`` -> ``tests/a/b``, ``a/b.py`` ->
    ``tests/a/test_b.py``. SystemExit naming --tests when it does not exist."""
    path = package.rstrip("/")
    if path.endswith(".py"):
        head, name = os.path.split(path)
        mirror = os.path.join("tests", head, "test_" + name)
    else:
        mirror = os.path.join("tests", path)
    if not os.path.exists(os.path.join(REPO, mirror)):
        raise SystemExit(f"error: {package} has no mirror {mirror}; name its tests with "
                         f"--tests PATH")
    return [mirror]


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse what would mutate or run something outside the repository."""
    for path in [args.package, *args.tests]:
        full = os.path.realpath(os.path.join(REPO, path))
        if os.path.isabs(path) or not full.startswith(REPO + os.sep) or not os.path.exists(full):
            raise SystemExit(f"error: {path} is not a path inside the repository")
    if args.sample is not None and args.sample < 1:
        raise SystemExit(f"error: --sample must be >= 1, got {args.sample}")


def copy_tree(dest: str) -> None:
    """The working tree as git sees it (tracked files still present, untracked files not
    ignored) into ``dest``; without git, everything but :data:`NOT_COPIED`."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"],
                                cwd=REPO, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*NOT_COPIED))
        return
    for rel in filter(None, listed.decode().split("\0")):
        src = os.path.join(REPO, rel)
        if os.path.isfile(src):   # a tracked file deleted in the working tree is skipped
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel), follow_symlinks=False)


def commit_of_checkout() -> str:
    """HEAD, marked when the working tree differs from it; "" without git."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + (" (+ uncommitted changes)" if head and git("status", "--porcelain")
                       else "")
    except OSError:
        return ""


def list_mutants(package: str, session: str) -> list:
    """Every mutant of ``package`` (cosmic-ray work items, one mutation each), in the
    order of (file, position, operator, occurrence): the same list for the same code,
    whatever order cosmic-ray stored them in. Run with the copy as the working directory."""
    from pathlib import Path

    import cosmic_ray.commands
    import cosmic_ray.modules
    from cosmic_ray.work_db import WorkDB, use_db
    modules = sorted(cosmic_ray.modules.find_modules([Path(package)]))
    with use_db(session, WorkDB.Mode.create) as db:
        cosmic_ray.commands.init(modules, db, {})
        items = list(db.work_items)

    def key(item):
        m = item.mutations[0]
        return (str(m.module_path), m.start_pos, m.operator_name, m.occurrence)
    return sorted(items, key=key)


def draw(items: list, sample: Optional[int], seed: int) -> list:
    """All of ``items``, or ``sample`` of them drawn by ``random.Random(seed)``, kept in
    ``items``' order."""
    if sample is None or sample >= len(items):
        return list(items)
    chosen = set(random.Random(seed).sample(range(len(items)), sample))
    return [item for i, item in enumerate(items) if i in chosen]


def survivors_of(items: list, report_path: str) -> list:
    """The ``items`` that survived in the report at ``report_path``, matched by file,
    position, operator and occurrence. SystemExit when one is missing: the package's code
    changed since that report, so its mutants are no longer the same."""
    with open(report_path, encoding="utf-8") as f:
        wanted = {(s["file"], s["line"], s["col"], s["operator"], s["occurrence"])
                  for s in json.load(f)["survivors"]}
    by_key = {}
    for item in items:
        m = as_mutant(item)
        by_key[(m.file, m.line, m.col, m.operator, m.occurrence)] = item
    missing = wanted - set(by_key)
    if missing:
        raise SystemExit(f"error: {len(missing)} survivor(s) of {report_path} are not mutants "
                         f"of this code (it changed since): {sorted(missing)[:3]}")
    return [item for key, item in by_key.items() if key in wanted]


def as_mutant(item) -> Mutant:
    m = item.mutations[0]
    return Mutant(file=str(m.module_path), line=m.start_pos[0], col=m.start_pos[1],
                  operator=m.operator_name.split("/", 1)[-1], occurrence=m.occurrence)


def pytest_command(tests: Sequence[str], extra: str = "") -> str:
    """pytest in a new interpreter, stopping at the first failure (one kills the mutant);
    pytest.ini's report options dropped (``-o addopts=``); ``extra`` (``--pytest-args``,
    shell-quoted) goes before the test paths."""
    return shlex.join([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                       "-o", "addopts=", *shlex.split(extra), *tests])


def run_baseline(command: str) -> float:
    """Seconds the tests take on the unmutated copy. SystemExit with their output when
    they fail there: every mutant would count as killed."""
    from cosmic_ray.testing import run_tests
    from cosmic_ray.work_item import TestOutcome
    start = time.monotonic()
    outcome, output = run_tests(command, 3600)
    if outcome != TestOutcome.SURVIVED:
        tail = "\n".join(str(output).splitlines()[-30:])
        raise SystemExit(f"error: the tests fail without any mutation ({command}):\n{tail}")
    return time.monotonic() - start


def run_one(item, mutant: Mutant, command: str, timeout: float) -> None:
    """Write ``item``'s mutation into the copy, run the tests, put the file back, and
    record the outcome in ``mutant``."""
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome
    start = time.monotonic()
    result = mutate_and_test(item.mutations, command, timeout)
    mutant.seconds = round(time.monotonic() - start, 2)
    if result.worker_outcome != WorkerOutcome.NORMAL:
        mutant.outcome = "incompetent"
    elif result.test_outcome == TestOutcome.SURVIVED:
        mutant.outcome = "survived"
    elif result.test_outcome == TestOutcome.KILLED:
        mutant.outcome = "timeout" if result.output == "timeout" else "killed"
    else:
        mutant.outcome = "incompetent"
    mutant.diff = [line for line in (result.diff or "").splitlines()
                   if line[:1] in "-+" and not line.startswith(("---", "+++"))]


def write_json(report: Report, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(report.to_json(), f, indent=1)
    os.replace(path + ".tmp", path)


def print_summary(report: Report, path: str) -> None:
    rate = report.kill_rate()
    killed, survived = report.count("killed", "timeout"), report.count("survived")
    print(f"\n{report.package}: {killed} of {killed + survived} mutants killed"
          f" ({'n/a' if rate is None else f'{100 * rate:.1f} %'}; {report.count('timeout')}"
          f" by the {report.timeout_s:.0f} s timeout), {report.count('incompetent')} "
          f"incompetent; {len(report.mutants)} run of {report.mutants_total}"
          + (f" (--sample {report.sample} --seed {report.seed})" if report.sample else "")
          + f", {report.elapsed_s / 60:.1f} min")
    for m in report.mutants:
        if m.outcome == "survived":
            print(f"  survived {m.file}:{m.line} {m.operator}")
            for line in m.diff:
                print(f"      {line.strip()[:1]} {line[1:].strip()}")
    print(f"report: {path}")


def run(args: argparse.Namespace, work: str, out: str) -> int:
    """Steps 1-5 of the module docstring, in the copy ``work``."""
    copy_tree(work)
    os.chdir(work)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [work, os.environ.get("PYTHONPATH")]))
    items = list_mutants(args.package, os.path.join(work, ".mutation-session.sqlite"))
    chosen = (survivors_of(items, args.survivors_of) if args.survivors_of
              else draw(items, args.sample, args.seed))
    command = pytest_command(args.tests, args.pytest_args)
    print(f"[mutation] {args.package}: {len(items)} mutants, {len(chosen)} to run; tests: "
          f"{command}", flush=True)
    if args.count_only:
        return 0
    baseline = run_baseline(command)
    from importlib.metadata import version
    report = Report(tool=f"cosmic-ray {version('cosmic-ray')}",
                    command=shlex.join(["bash", "scripts/mutation.sh", *args.argv]),
                    commit=commit_of_checkout(), package=args.package, tests=args.tests,
                    seed=args.seed, sample=args.sample, mutants_total=len(items),
                    baseline_s=round(baseline, 2),
                    timeout_s=args.timeout or max(30.0, round(5 * baseline)),
                    mutants=[as_mutant(item) for item in chosen])
    print(f"[mutation] baseline {baseline:.1f} s, timeout {report.timeout_s:.0f} s per mutant",
          flush=True)
    start = time.monotonic()
    for n, (item, mutant) in enumerate(zip(chosen, report.mutants), 1):
        run_one(item, mutant, command, report.timeout_s)
        report.elapsed_s = round(time.monotonic() - start, 1)
        write_json(report, out)
        print(f"[{n:4d}/{len(chosen)}] {mutant.outcome:<11} {mutant.file}:{mutant.line} "
              f"{mutant.operator} ({mutant.seconds:.1f} s)", flush=True)
    write_json(report, out)
    print_summary(report, out)
    rate = report.kill_rate()
    return 1 if args.fail_under is not None and (rate or 0) * 100 < args.fail_under else 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.package = os.path.normpath(args.package)
    args.tests = args.tests or []
    check_inputs(args)
    args.tests = args.tests or default_tests(args.package)
    slug = args.package.replace(os.sep, ".").removesuffix(".py")
    if args.sample:
        slug += f"-sample{args.sample}-seed{args.seed}"
    if args.survivors_of:
        args.survivors_of = os.path.abspath(args.survivors_of)
        slug = os.path.basename(args.survivors_of).removesuffix(".json") + "-survivors"
    out = os.path.abspath(args.json or os.path.join(REPO, "runs", "mutation", slug + ".json"))
    work = tempfile.mkdtemp(prefix="moc-mutation-")
    try:
        return run(args, work, out)
    finally:
        os.chdir(REPO)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
