"""A run can be entered again in the same process: what an in-job restart stands on.

Two CPU ranks (gloo) each run the same short job twice in one process, with MoC's two
levels (a keeper, snapshot slots, the seal and persist threads) and expert parallelism:
the second run forms its process group again on the store that outlived the first (a
new prefix, as a restart round), builds DeepSpeed's groups and engine again and trains
to the same losses, bit for bit; nothing of the first run is left running or referenced.
"""

import json
import os

from tests.launch import describe, run_ranks
from tests.shm import new_shm_dir, stop_keepers

WORKER = os.path.join("tests", "training", "reentry_worker.py")


def test_a_job_runs_twice_in_one_process_with_equal_losses(corpus, tmp_path):
    shm = new_shm_dir()
    job = ["--config", "configs/tiny.yaml", "--split", "90,10,0", "--data-path", corpus,
           "--moe-expert-parallel-size", "2", "--train-iters", "3", "--eval-interval", "2",
           "--save", str(tmp_path / "ckpt{round}"), "--moc-checkpoint", "--moc-two-level",
           "--moc-snapshot-interval", "1", "--moc-persist-interval", "2",
           "--moc-shm-dir", shm]
    try:
        results = run_ranks(2, [str(tmp_path), "2", "--", *job], script=WORKER, timeout=180)
    finally:
        stop_keepers(shm)
    assert all(r.returncode == 0 for r in results), describe(results)
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            first, second = json.load(f)
        assert len(first["losses"]) == 3 and first["iteration"] == 3
        assert second["losses"] == first["losses"], (rank, first, second)
        for run in (first, second):
            # closed: no process group, no cached DeepSpeed group, no thread of the run,
            # no parameter (each holds its groups' connections open; a peer blocked in a
            # collective with this process would wait out the timeout)
            assert not run["initialized"] and run["deepspeed_expert_groups"] == 0, run
            assert run["parameters"] == 0, run
            assert run["threads"] == [], run
    # each run persisted its own checkpoints and freed the node's memory at its end
    for n in (0, 1):
        assert (tmp_path / f"ckpt{n}" / "latest").read_text().strip() == "global_step3"
    assert not os.path.exists(shm)
