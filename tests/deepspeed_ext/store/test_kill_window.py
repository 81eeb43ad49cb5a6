"""Randomized kills across the save/persist/commit window of two-level checkpointing.

Each trial is one job of two ranks on one node: the training side (this process) saves
tags as :class:`deepspeed_ext.two_level.TwoLevel` does (rank 0 prepares and claims the
directory, each rank hands its persist job to the node's keeper, rank 0's job commits),
against a real keeper process (``kill_window_worker.py``) that sleeps a seeded random
moment before each commit step. A trial kills, at a seeded random point, a rank (it
never hands its job over, and the job ends there), the keeper (SIGKILL before or after
one of its commit steps), or nothing (the job ends with its final wait). After each:
``moc-ckpt verify`` passes right away (while a keeper of the dead job may still be
committing, as it is meant to) and once the keeper is gone; ``latest`` names a
checkpoint with a valid manifest; a restart finds a checkpoint and loads its tensors.
"""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from deepspeed_ext import cli, keeper
from deepspeed_ext.format import assemble
from deepspeed_ext.format import manifest as mf
from deepspeed_ext.store import claims, commit, prepare
from deepspeed_ext.store.latest import read_latest
from tests.launch import REPO
from tests.shm import new_shm_dir, stop_keepers

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_window_worker.py")
STEPS = 5
KEEP = 2
COMMIT_TIMEOUT_S = 2.0
KEEPER_STEPS = ["write_report", "write_manifest", "advance_latest", "retain_unless_superseded",
                "remove_checkpoint"]


def _plan(seed):
    """``(kill, step, keeper_kill)`` of a trial: what dies, at which save, and the
    keeper's ``KILL_AT``."""
    rng = random.Random(seed)
    kind = ["none", "rank", "keeper"][seed % 3]  # every kind in any three trials
    step = rng.randint(2, STEPS)
    if kind != "keeper":
        return kind, step, "-"
    name = rng.choice(KEEPER_STEPS)
    # Calls before the kill: two reports per save; one of the others per commit.
    n = {"write_report": rng.randint(3, 2 * STEPS)}.get(name, rng.randint(2, STEPS - 1))
    return kind, step, f"{name}:{rng.choice(['before', 'after'])}:{n}"


def _job(node, save_dir, tag, step, rank, claim, attempt):
    """Rank ``rank``'s persist job of ``tag``: a slot image of one tensor filled with
    ``step`` (a restart checks what it loads), rank 0's with the objects and the commit."""
    import torch
    from deepspeed_ext.format.image import fill_image, layout_of
    from deepspeed_ext.format.objects import encode
    spec = assemble.FragmentSpec("w", "fp32", 4 * rank, 4, (8,), "float32")
    tensors = {spec.key: torch.full((4,), float(step))}
    layout = layout_of(tensors)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    fill_image(buffer, layout, tensors)
    image = os.path.join(node, f"{tag}.rank{rank}.img")
    with open(image, "wb") as f:
        f.write(buffer.numpy().tobytes())
    job = {"image": image, "keys": None, "specs": [spec.to_json()],
           "entries": [{"key": e.key, "dtype": e.dtype, "shape": list(e.shape),
                        "start": e.start, "nbytes": e.nbytes} for e in layout.entries],
           "save_dir": save_dir, "tag": tag, "step": step, "rank": rank, "claim": claim,
           "objects_tree": encode({"step": step})[0] if rank == 0 else None,
           "id": keeper.job_id(tag, rank)}
    if rank == 0:
        job["commit"] = {"step": step, "previous_tag": None, "selected": None, "pec_k": None,
                         "save_latest": True, "keep": KEEP, "timeout_s": COMMIT_TIMEOUT_S,
                         "attempt_started": attempt,
                         "layout": {"world_size": 2, "ep_size": 1, "zero_stage": 2,
                                    "num_moe_layers": 0, "num_experts": 0}}
    return job


def _start_keeper(node, save_dir, seed, kill_at):
    keeper.claim_node_dir(node)
    proc = subprocess.Popen([sys.executable, WORKER, str(seed), kill_at, "--", "--dir", node,
                             "--idle-timeout", "60", "--save-dir", save_dir],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not keeper.alive(node):
        assert proc.poll() is None and time.monotonic() < deadline, "the keeper did not start"
        time.sleep(0.05)
    return proc


def _outcome(node, tag_dir, claim):
    """Rank 0's wait for one commit: its outcome, or None when the keeper died."""
    while True:
        outcome = commit.commit_outcome(tag_dir, 2, claim)
        if outcome is not None:
            return outcome
        if keeper.is_dead(node):
            return None
        time.sleep(0.01)


def _verify(save_dir):
    """``moc-ckpt verify`` of everything: its exit status and output."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["verify", save_dir])
    return rc, out.getvalue()


def _check_storage(save_dir, expect_step=None):
    """``latest`` names a checkpoint with a valid manifest, verify passes, and a restart
    finds a checkpoint whose tensor holds its step."""
    from deepspeed_ext.store.reader import CheckpointReader, find_loadable
    latest = read_latest(save_dir)
    if latest is not None:
        assert mf.read_manifest(os.path.join(save_dir, latest)).tag == latest
    rc, out = _verify(save_dir)
    assert rc == 0, out
    tag, _ = find_loadable(save_dir)
    assert tag is not None
    with CheckpointReader(save_dir, tag) as reader:
        step = reader.step
        assert reader.read_full("w", "fp32").tolist() == [float(step)] * 8
    if expect_step is not None:
        assert latest == f"global_step{expect_step}" and step == expect_step
    return tag


@pytest.mark.parametrize("seed", range(6))
def test_kills_across_the_commit_window_leave_latest_valid(tmp_path, seed):
    kind, kill_step, kill_at = _plan(seed)
    shm, save_dir = new_shm_dir(), str(tmp_path / "ckpt")
    node = os.path.join(shm, "node0")
    try:
        proc = _start_keeper(node, save_dir, seed, kill_at)
        attempt = time.time()
        ended = False  # the job ended by a death (a rank's, or its keeper's)
        for step in range(1, STEPS + 1):
            tag = f"global_step{step}"
            tag_dir = prepare.prepare_checkpoint_dir(save_dir, tag, attempt_started=attempt)
            claim = claims.read_claim(tag_dir)
            for rank in (1, 0):
                if kind == "rank" and step == kill_step and rank == 1:
                    continue  # rank 1 died before handing its share over
                if not keeper.hand_over(node, _job(node, save_dir, tag, step, rank, claim, attempt),
                                        patience_s=30):
                    ended = True  # the keeper is dead: the job fails
            if kind == "rank" and step == kill_step:
                ended = True  # the survivor's next collective fails: the launcher ends it
            if ended or _outcome(node, tag_dir, claim) is None:
                ended = True
                break
        if not ended:
            # The final wait (TwoLevel.wait, then shutdown): every commit of the attempt
            # done before it returns, then the keeper stopped and gone.
            keeper.drain_keeper(node, 60, None, attempt)
            _check_storage(save_dir, expect_step=STEPS)
            assert keeper.shutdown_keeper(node, 60, None, attempt)
            assert keeper.has_exited(proc.pid)
            return
        # The job died: verify right away, while its keeper may still be committing.
        rc, out = _verify(save_dir)
        assert rc == 0, out
        proc.wait(timeout=COMMIT_TIMEOUT_S * STEPS + 30) if kind == "keeper" else None
        if proc.poll() is None:  # a dead job's keeper: SIGKILLed once its commits ended
            keeper.drain_keeper(node, 60, None, None)
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        _check_storage(save_dir)
    finally:
        stop_keepers(shm)
