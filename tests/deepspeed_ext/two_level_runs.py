"""Running two-level jobs of the engine worker in tests (``test_two_level``, ``test_peers``):
the worker, its flags, a run's per-rank results, and a node keeper's pid."""

import json

from tests.launch import describe, run_ranks

WORKER = "tests/deepspeed_ext/engine_worker.py"


def flags(shm, nproc, ep, extra=()):
    """The worker's flags for a two-level job of ``nproc`` ranks, expert-parallel ``ep``."""
    return ["--moe-expert-parallel-size", str(ep), "--zero-stage", "2",
            "--global-batch-size", str(2 * nproc), "--moc-checkpoint", "--moc-two-level",
            "--moc-shm-dir", shm, *extra]


def run(tmp_path, name, nproc, action, flags, env=None, ok=True):
    """Run the worker's ``action`` on ``nproc`` ranks with results in ``tmp_path/name``;
    returns every rank's result and the processes (``ok``: every rank must exit 0)."""
    out = tmp_path / name
    out.mkdir()
    results = run_ranks(nproc, [action, str(out)] + flags, script=WORKER, timeout=300, env=env)
    if ok:
        assert all(r.returncode == 0 for r in results), describe(results)
    missing = [r for r in range(nproc) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"no result from rank(s) {missing}\n" + describe(results)
    return [json.load(open(out / f"rank{r}.json")) for r in range(nproc)], results


def keeper_pid(node_dir):
    """The pid of the keeper serving ``node_dir``."""
    from deepspeed_ext.keeper import request
    return request(node_dir, {"op": "ping"})["pid"]


def committed(ckpt, tag):
    """Whether the commit of ``tag`` under ``ckpt`` has ended: its manifest, then
    ``latest`` naming it (a test that deletes or kills once the manifest alone exists
    races with the keeper writing ``latest`` right after it)."""
    import os
    latest = os.path.join(ckpt, "latest")
    if not os.path.exists(os.path.join(ckpt, tag, "manifest.json")) or not os.path.exists(latest):
        return False
    with open(latest) as f:
        return f.read().strip() == tag
