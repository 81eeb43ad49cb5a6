"""The state description covers every element of every tensor exactly once (ZeRO) or
names every holder (no ZeRO), with global expert names, on real multi-rank engines; an
optimizer without moments yet is saved and recovered as it was."""

import json
import signal
from collections import defaultdict

import pytest

from tests.launch import describe, run_ranks

WORKER = "tests/deepspeed_ext/engine_worker.py"


def _describe(tmp_path, nproc, flags):
    results = run_ranks(nproc, ["describe", str(tmp_path)] + flags, script=WORKER)
    assert all(r.returncode == 0 for r in results), describe(results)
    return [json.load(open(tmp_path / f"rank{r}.json"))["fragments"] for r in range(nproc)]


@pytest.mark.parametrize("nproc, ep, zero", [(2, 2, 2), (4, 2, 1), (2, 1, 0)])
def test_fragments_cover_the_global_state(tmp_path, nproc, ep, zero):
    per_rank = _describe(tmp_path, nproc, ["--moe-expert-parallel-size", str(ep),
                                           "--zero-stage", str(zero)])
    covered = defaultdict(list)
    shapes = {}
    for rank, frags in enumerate(per_rank):
        for name, kind, shape, offset, length, expert, holders in frags:
            covered[(name, kind)].append((offset, length, tuple(holders), rank))
            shapes[name] = shape
            if ".deepspeed_experts." in name:
                index = int(name.split(".deepspeed_experts.")[1].split(".")[0])
                assert expert is not None and expert[1] == index
    experts = {n for n, _ in covered if ".deepspeed_experts." in n}
    assert len({n.split(".deepspeed_experts.")[1].split(".")[0] for n in experts}) == 4  # global ids 0-3
    for (name, kind), frags in covered.items():
        numel = 1
        for d in shapes[name]:
            numel *= d
        if zero > 0:
            # Partitioned: every element owned by exactly one rank.
            spans = sorted((o, o + n) for o, n, _, _ in frags)
            assert spans[0][0] == 0 and spans[-1][1] == numel, (name, kind, spans)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, kind, spans)
            assert all(h == (r,) for _, _, h, r in frags)
        else:
            # Replicated: each holder holds it whole, and lists the same holders.
            assert all(o == 0 and n == numel for o, n, _, _ in frags)
            holders = {h for _, _, h, _ in frags}
            assert len(holders) == 1 and sorted(r for *_, r in frags) == list(next(iter(holders)))
    kinds = {k for _, k in covered}
    assert kinds == {"fp32", "exp_avg", "exp_avg_sq"}


# -- an engine without moments (before the first fp16 step that does not overflow) -------

def _early_flags(tmp_path, two_level, shm):
    flags = ["--moe-expert-parallel-size", "2", "--zero-stage", "2", "--global-batch-size",
             "4", "--train-iters", "3", "--save", str(tmp_path / "ckpt")]
    if two_level:
        flags += ["--moc-two-level", "--moc-shm-dir", shm, "--moc-persist-interval", "100"]
    return flags


def _run_early(tmp_path, name, action, flags, env=None, ok=True):
    out = tmp_path / name
    out.mkdir()
    results = run_ranks(2, [action, str(out), "--moc-checkpoint"] + flags, script=WORKER,
                        timeout=300, env=env)
    if ok:
        assert all(r.returncode == 0 for r in results), describe(results)
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)], results


def _moment_keys(state):
    return [k for k in state if not k.endswith("|fp32")]


@pytest.mark.parametrize("two_level", [True, False], ids=["two-level", "single-level"])
def test_a_save_without_moments_recovers_as_it_was(tmp_path, two_level):
    """A 2-rank ZeRO-2 job saves at step 1 while its optimizer holds no moments (as after
    an fp16 first step that overflowed) and is SIGKILLed; the restart (a fresh engine)
    recovers from that save (two-level: from memory) with no moments either, and its
    steps 2-3 (which create them, and save snapshots that now hold them) equal the
    uninterrupted run's bitwise. Before, the load created zero moments and the recovery
    failed ("snapshot of step 1 lacks ...|exp_avg|...", then the storage load too)."""
    from tests.shm import new_shm_dir, stop_keepers
    shm = new_shm_dir()
    flags = _early_flags(tmp_path, two_level, shm)
    try:
        first, results = _run_early(tmp_path, "first", "early-save", flags,
                                    env={"MOC_TEST_CRASH": "1"}, ok=False)
        assert all(r.returncode == -signal.SIGKILL for r in results), describe(results)
        saved = first[0]["states"]
        assert not _moment_keys(saved["1"]) and _moment_keys(saved["3"])  # the imitation
        second, _ = _run_early(tmp_path, "second", "load-train-save", flags + [
            "--load", str(tmp_path / "ckpt"), "--save-interval", "1"])
        for r in second:
            assert r["client_state"] == {"step": 1}, r["client_state"]
            if two_level:
                assert r["load_source"] == "memory", r["load_source"]
            assert r["state_after_load"] == saved["1"]  # no moments made up
            assert r["losses"] == first[r["rank"]]["losses"]
            assert r["final_state"] == saved["3"]
    finally:
        stop_keepers(shm)


def test_a_snapshot_without_moments_reloads_into_an_engine_that_has_them(tmp_path):
    """In one process: a two-level snapshot at step 1 without moments, two more steps
    (the moments exist now), then a load from memory: the moments go again, and the
    same steps, now snapshotted every step (the description and the slots' layout change
    under them), equal the first pass bitwise; the newest of those snapshots loads back."""
    from tests.shm import new_shm_dir, stop_keepers
    shm = new_shm_dir()
    try:
        res, _ = _run_early(tmp_path, "reload", "early-save",
                            _early_flags(tmp_path, True, shm) + ["--save-interval", "1"],
                            env={"MOC_TEST_RELOAD": "1"})
        for r in res:
            first = r["states"]
            assert r["reloaded"]["source"] == "memory", r["reloaded"]
            assert r["reloaded"]["client_state"] == {"step": 1}
            assert r["reloaded"]["state"] == first["1"]  # no moments
            assert r["losses_again"] == r["losses"]
            assert sorted(r["states_again"]) == ["2", "3"]
            assert all(r["states_again"][k] == first[k] for k in ("2", "3"))
            assert r["reloaded_newest"]["source"] == "memory", r["reloaded_newest"]
            assert r["reloaded_newest"]["client_state"] == {"step": 3}
            assert r["reloaded_newest"]["state"] == first["3"] and _moment_keys(first["3"])
    finally:
        stop_keepers(shm)


def test_the_moments_record_is_checked():
    """What a checkpoint says of its moments is a list of booleans or nothing (an older
    checkpoint: every group's moments, as before); anything else is damage."""
    from deepspeed_ext.state import MomentPresence
    assert MomentPresence.from_record(None) is None
    assert MomentPresence.from_record([True, False]) == MomentPresence((True, False))
    assert MomentPresence((False,)).to_record() == [False]
    for bad in ([1, 0], "true", [True, None], {"0": True}):
        with pytest.raises(ValueError):
            MomentPresence.from_record(bad)
