"""The test launcher (tests/launch.py) reports a hung job usefully: which rank still ran
at the timeout, and what every rank printed (a peer's error is usually the cause)."""

import pytest

from tests.launch import REPO, run_ranks


def test_a_hung_rank_is_killed_and_every_rank_output_is_shown(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, time\n"
                      "rank = int(os.environ['RANK'])\n"
                      "print('rank', rank, 'fails: connection reset' if rank == 1 else 'waits',"
                      " flush=True)\n"
                      "time.sleep(60 if rank == 0 else 0)\n")
    # 8 s: rank 1 has ended well before on a loaded machine (a forked rank's exit runs the
    # imported libraries' atexit handlers; at 2 s it was once reported as still running).
    with pytest.raises(AssertionError,
                       match=r"(?s)rank\(s\) \[0\] still running after 8 s.*"
                             r"rank 0 \(exit -9\).*waits.*rank 1 \(exit 0\).*connection reset"):
        run_ranks(2, [], script=str(script), timeout=8)


def test_a_forked_rank_runs_its_script_as_a_new_interpreter_would(tmp_path):
    """What a rank sees of its start (environment, argv, working directory, umask,
    ``__name__``, stdin, the exit status of SystemExit, an exception and a signal) is what
    ``python SCRIPT ARGS`` gives it, although it was forked from the fork server."""
    import os
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, signal\n"
        "rank = int(os.environ['RANK'])\n"
        "print('argv', sys.argv[1:], 'name', __name__, 'cwd', os.getcwd(), flush=True)\n"
        "print('umask', oct(os.umask(0)), 'extra', os.environ.get('MOC_TEST_EXTRA'),"
        " 'stdin', repr(sys.stdin.read()), 'path0', sys.path[0], flush=True)\n"
        "print('torch already imported', 'torch' in sys.modules, flush=True)\n"
        "if rank == 1: sys.exit(3)\n"
        "if rank == 2: raise ValueError('boom')\n"
        "if rank == 3: os.kill(os.getpid(), signal.SIGKILL)\n")
    old = os.umask(0o027)
    try:
        results = run_ranks(4, ["a", "b c"], script=str(script), timeout=60,
                            env={"MOC_TEST_EXTRA": "x"})
    finally:
        os.umask(old)
    assert [r.returncode for r in results] == [0, 3, 1, -9]
    for r in results:
        assert f"argv ['a', 'b c'] name __main__ cwd {REPO}" in r.output, r.output
        assert f"umask 0o27 extra x stdin '' path0 {tmp_path}" in r.output, r.output
    assert "ValueError: boom" in results[2].output
    # Forked: the server's imports are there (else this test measures nothing of it).
    assert "torch already imported True" in results[0].output


def test_a_rank_whose_startup_environment_differs_gets_a_new_interpreter(tmp_path):
    """A variable an interpreter reads at start (here PYTHONHASHSEED) would not reach a
    forked rank: such a rank is started fresh, and sees it."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys\n"
                      "print('torch already imported', 'torch' in sys.modules,"
                      " 'hash', sys.flags.hash_randomization, flush=True)\n")
    results = run_ranks(1, [], script=str(script), timeout=60, env={"PYTHONHASHSEED": "0"})
    assert results[0].returncode == 0
    assert "torch already imported False hash 0" in results[0].output
