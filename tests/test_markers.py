"""The ``e2e`` marker (tests/process_rule.py; set by tests/conftest.py, guarded by
tests/process_guard.py): the rule marks the tests that start processes and leaves the others to ``bash scripts/test.sh --fast``; collection applies it; the guard
fails an unmarked test that starts a process.

The rule is checked three ways: on a small made-up repository whose every path to a
process is known (each way of reaching one, and each thing that must not count); on a
sample of this suite's own tests, known to start processes or known pure; and on this
session's collected tests (the hook gave every one the mark the rule gives it).
"""

import glob
import os
import sys
import textwrap

import pytest

from tests.process_guard import GUARD, ProcessGuard
from tests.process_rule import REPO, RULE, CodeIndex, e2e_reason, static_fixturenames

# ---------------------------------------------------------------------------------------
# A made-up repository.

FILES = {
    "lib/__init__.py": "",
    "lib/spawner/__init__.py": "from .boot import ensure\n",
    "lib/spawner/boot.py": """
        import subprocess

        def spawn(cmd):
            subprocess.Popen(cmd)

        def ensure(cmd):
            spawn(cmd)

        def table():
            return {"spawn": spawn}  # named, not called: a dispatch table starts nothing

        class Client:
            def __init__(self):
                self.pid = None

            def connect(self):
                ensure(["keeper"])
        """,
    "tests/__init__.py": "",
    "tests/helpers.py": """
        import multiprocessing as mp
        import os

        def run_job():
            return _start()

        def _start():
            return mp.get_context("spawn").Process(target=print)

        def pure():
            return os.path.join("a", "b")

        class Job:
            def run(self):
                os.system("true")
        """,
    "tests/conftest.py": """
        import pytest
        from tests.helpers import run_job

        @pytest.fixture(scope="session")
        def job():
            return run_job()

        @pytest.fixture
        def quiet():
            return 1
        """,
    "tests/test_x.py": """
        import pytest
        from lib import spawner
        from tests import helpers
        from tests.helpers import Job, pure

        @pytest.fixture
        def quiet():  # overrides conftest's, and this one starts a process
            return helpers.run_job()

        @pytest.fixture(name="renamed")
        def _renamed():
            return helpers.run_job()

        def test_reexport():
            spawner.ensure(["x"])

        def test_local_import():
            from lib.spawner.boot import spawn as s
            s(["x"])

        def test_helper_chain():
            helpers.run_job()

        def test_helper_class_method():
            Job()

        def test_library_constructor_only():
            spawner.boot.Client()  # a library object's methods are not followed

        def test_a_name_inside_a_process_module():
            from concurrent.futures.process import ProcessPoolExecutor as Pool
            Pool(2)

        def test_dispatch_table():
            spawner.boot.table()

        def test_pure():
            assert pure() == "a/b"

        def test_fixture_from_conftest(job):
            pass

        def test_fixture_overridden_in_module(quiet):
            pass

        def test_fixture_by_its_name_kwarg(renamed):
            pass

        @pytest.mark.parametrize("x", [helpers.run_job])
        def test_decorators_run_at_collection(x, cmd=helpers.run_job):
            pass

        class TestSelf:
            def _go(self):
                import subprocess
                subprocess.run(["true"])

            def test_self_method(self):
                self._go()

            def test_pure_method(self):
                assert True
        """,
    "tests/sub/test_y.py": """
        def test_conftest_of_a_parent(quiet):
            pass
        """,
}

STARTS = {"test_reexport": "lib.spawner.boot.spawn -> subprocess.Popen",
          "test_local_import": "lib.spawner.boot.spawn -> subprocess.Popen",
          "test_a_name_inside_a_process_module":
              "concurrent.futures.process.ProcessPoolExecutor",
          "test_helper_chain": "tests.helpers._start -> multiprocessing.get_context",
          "test_helper_class_method": "tests.helpers.Job.run -> os.system",
          "test_fixture_from_conftest": "fixture job: tests.conftest.job",
          "test_fixture_overridden_in_module": "fixture quiet: tests.test_x.quiet",
          "test_fixture_by_its_name_kwarg": "fixture renamed: tests.test_x._renamed",
          "TestSelf.test_self_method": "tests.test_x.TestSelf._go -> subprocess.run"}
PURE = ("test_library_constructor_only", "test_dispatch_table", "test_pure",
        "test_decorators_run_at_collection", "TestSelf.test_pure_method")


@pytest.fixture
def made_up(tmp_path):
    for rel, text in FILES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return CodeIndex(str(tmp_path)), str(tmp_path / "tests" / "test_x.py")


@pytest.mark.parametrize("test", sorted(STARTS))
def test_each_way_to_a_process_is_followed(made_up, test):
    index, path = made_up
    why = e2e_reason(index, path, test, static_fixturenames(index, path, test))
    assert why and STARTS[test] in why, why


@pytest.mark.parametrize("test", PURE)
def test_what_starts_no_process_in_the_test_is_not_counted(made_up, test):
    index, path = made_up
    assert e2e_reason(index, path, test, static_fixturenames(index, path, test)) is None


def test_a_fixture_of_a_parent_directorys_conftest_is_found(made_up):
    index, _ = made_up
    path = os.path.join(index.root, "tests", "sub", "test_y.py")
    assert e2e_reason(index, path, "test_conftest_of_a_parent", ["quiet"]) is None
    assert "tests.conftest.job" in e2e_reason(index, path, "test_conftest_of_a_parent", ["job"])


def test_a_recursion_ends_and_a_name_not_ours_starts_nothing(made_up, tmp_path):
    (tmp_path / "tests" / "test_z.py").write_text(textwrap.dedent("""
        import subprocess
        import numpy

        def a():
            b()
            subprocess.run(["true"])

        def b():
            return a()

        def c():
            return d()

        def d():
            numpy.zeros(3)
            return c()

        def test_via_a():
            a()

        def test_via_b():
            b()

        def test_cycle():
            c()
        """))
    index, _ = made_up
    path = str(tmp_path / "tests" / "test_z.py")
    # b's "no" while a was still being read is not kept: a starts a process after it.
    assert "test_via_a -> tests.test_z.a -> subprocess.run" in e2e_reason(index, path,
                                                                          "test_via_a", [])
    assert "tests.test_z.b -> tests.test_z.a -> subprocess.run" in e2e_reason(index, path,
                                                                               "test_via_b", [])
    assert e2e_reason(index, path, "test_cycle", []) is None


# ---------------------------------------------------------------------------------------
# This suite's own tests.

def _find(name: str, test: str = "") -> str:
    """The test file ``name`` that defines ``test``, wherever tests/ keeps it (files move
    as the tree is sorted)."""
    found = [path for path in glob.glob(os.path.join(REPO, "tests", "**", name), recursive=True)
             if not test or f"def {test}(" in open(path, encoding="utf-8").read()]
    assert len(found) == 1, f"{name}::{test}: {found}"
    return found[0]


KNOWN_E2E = [
    ("test_two_level.py", "test_crash_then_recover_from_memory_bitwise",
     "tests.deepspeed_ext.two_level_runs.run -> tests.launch.run_ranks"),
    ("test_restart.py", "test_hang_is_detected_named_and_the_job_restarts", "subprocess.run"),
    ("test_exact.py", "test_crash_mid_window_replays_to_the_bit", "tests.launch.run_ranks"),
    ("test_pipeline_training.py", "test_two_pipeline_stages_train_as_one",
     "tests.launch.run_ranks"),
    ("test_job_identity.py", "test_two_jobs_sharing_a_shm_dir_neither_attach_nor_delete_each_"
     "other", "deepspeed_ext.keeper.bootstrap.spawn -> subprocess.Popen"),
    ("test_manifest.py", "test_latest_linked_to_dev_zero_is_refused_not_read_forever",
     "tests.launch.fresh_python -> subprocess.run"),
    ("test_lr_schedule.py", "test_exit_duration_is_decided_by_every_rank_together",
     "multiprocessing.get_context"),
]
KNOWN_PURE_FILES = ("test_memsum.py", "test_copy_plan.py")
KNOWN_PURE = [("test_two_level.py", "test_the_shared_memory_check_adds_up_the_ranks_of_a_node"),
              ("test_exact.py", "test_operator_of"),
              ("test_startup.py", "test_startup_watch_reports_the_phase_that_outlasts_the_timeout_"
               "once"),
              ("test_cli.py", "test_inspect_all")]


@pytest.mark.parametrize("name, test, through", KNOWN_E2E)
def test_known_process_tests_are_marked(name, test, through):
    index, path = CodeIndex(), _find(name, test)
    why = e2e_reason(index, path, test, static_fixturenames(index, path, test))
    assert why and through in why, why


def test_known_pure_tests_are_not_marked():
    index = CodeIndex()
    tests = [(_find(f), node) for f in KNOWN_PURE_FILES
             for node in index.module_at(_find(f)).defs if node.startswith("test_")]
    tests += [(_find(f, t), t) for f, t in KNOWN_PURE]
    assert len(tests) > 20
    marked = {f"{os.path.basename(p)}::{t}": e2e_reason(index, p, t,
                                                         static_fixturenames(index, p, t))
              for p, t in tests}
    assert not {k: v for k, v in marked.items() if v}, marked


def test_collection_gave_each_test_the_rules_mark(request):
    """Every collected test of this session, deselected ones included, carries the mark
    the rule gives it (the hook is wired, before ``-m`` deselects); a mark written on a
    test is kept."""
    index, wrong = RULE.index, []
    for item in request.session.items + RULE.deselected:
        function = getattr(item, "function", None)
        if function is None:
            continue
        why = e2e_reason(index, str(item.path), function.__qualname__, item.fixturenames)
        mark = item.get_closest_marker("e2e")
        given = mark.kwargs.get("reason") if mark else None
        if why != given and not (mark is not None and given is None):  # written on it
            wrong.append(f"{item.nodeid}: rule {why!r}, mark {given!r}")
    assert not wrong, "\n".join(wrong[:20])


# ---------------------------------------------------------------------------------------
# The guard.

def test_the_guard_fails_a_test_naming_the_process_and_the_line():
    guard = ProcessGuard()
    guard.active = True  # its hook called by hand: no audit hook added, no process started
    guard.hook("open", ("/etc/hostname", "r", 0))
    guard.check(None)  # nothing started: passes
    guard.hook("subprocess.Popen", (sys.executable, ["python", "-c", "pass"], None, None))
    with pytest.raises(pytest.fail.Exception) as failed:
        guard.check(type("Item", (), {"nodeid": "tests/x.py::test_y"})())
    text = str(failed.value)
    assert "tests/x.py::test_y started a process but is not marked e2e" in text
    assert "['python', '-c', 'pass']" in text and "tests/test_markers.py:" in text
    guard.check(None)  # reported once


def test_deepspeeds_op_probe_is_tolerated_wherever_it_runs_first():
    """DeepSpeed compiles a test program once per process, in whichever test first reads
    its table of compatible ops: that process is not the test's."""
    guard = ProcessGuard()
    guard.active = True
    probe = "def has_function(guard):\n    guard.hook('subprocess.Popen', ('gcc', ['gcc']))\n"
    for path, expected in (("/x/deepspeed/ops/op_builder/builder.py", 0),
                           ("/x/deepspeed/ops/op_builder/other.py", 1)):
        scope = {}
        exec(compile(probe, path, "exec"), scope)
        scope["has_function"](guard)
        assert len(guard.started) == expected, (path, guard.started)


def test_a_session_of_unmarked_tests_is_guarded(request):
    if any(i.get_closest_marker("e2e") for i in request.session.items):
        pytest.skip("this session runs e2e tests too: the guard is armed only without them")
    import multiprocessing.util
    assert GUARD.active
    assert multiprocessing.util.spawnv_passfds.__name__ == "audited_spawnv_passfds"


@pytest.mark.e2e
def test_the_guard_sees_each_way_python_starts_a_process():
    """Real processes, through an armed guard of its own (its hook stays in this process,
    inactive after the test)."""
    import multiprocessing.util
    import subprocess
    guard = ProcessGuard()
    guard.arm()
    try:
        subprocess.run(["true"], check=True)
        os.system("true")
        pid = multiprocessing.util.spawnv_passfds(b"/bin/true", [b"true"], ())
        os.waitpid(pid, 0)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    finally:
        guard.active = False
    events = [s.split(" ")[0] for s in guard.started]
    assert events == ["subprocess.Popen", "os.system", "multiprocessing.spawnv_passfds",
                      "os.fork"], guard.started
