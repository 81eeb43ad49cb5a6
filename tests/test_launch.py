"""The test launcher (tests/launch.py) reports a hung job usefully: which rank still ran
at the timeout, and what every rank printed (a peer's error is usually the cause)."""

import pytest

from tests.launch import run_ranks


def test_a_hung_rank_is_killed_and_every_rank_output_is_shown(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, time\n"
                      "rank = int(os.environ['RANK'])\n"
                      "print('rank', rank, 'fails: connection reset' if rank == 1 else 'waits',"
                      " flush=True)\n"
                      "time.sleep(60 if rank == 0 else 0)\n")
    with pytest.raises(AssertionError,
                       match=r"(?s)rank\(s\) \[0\] still running after 2 s.*"
                             r"rank 0 \(exit -9\).*waits.*rank 1 \(exit 0\).*connection reset"):
        run_ranks(2, [], script=str(script), timeout=2)
