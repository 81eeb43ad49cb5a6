"""Localized recovery (deepspeed_ext.exact.local_replay, cross_stage): one pipeline stage
replays its steps alone from its neighbours' upstream logs and the other stages' records
of the all-reduces across stages, and ends in the state it had, to the bit; what the
upstream logs keep."""

import json

from tests.launch import describe, run_ranks


def test_a_stage_replays_alone_to_the_bit(tmp_path):
    """2 stages x 2 data-parallel ranks, experts over them, ZeRO-1 with a gradient clip
    that binds (0.05: the norm all-reduced over both stages decides every update), 4
    micro-batches per step (more than the pipeline's buffers). Stage 1 (the last: it
    computes the loss, holds the tied head) loses its state after step 4 and replays
    steps 3-4 from step 2's state; stage 0 (the first: it reads the data) after step 6,
    steps 5-6 from step 4's. Each time, on both of the failed stage's ranks: fp32
    masters, moments, compute weights and counters equal the state before the failure,
    and the activations or gradients it sends were logged again, equal; the steps after
    train on all ranks alike. The survivors' logs go through what an in-job restart does
    with them (kept off the engine, adopted back), and the failed stage's earlier state
    is restored as a survivor's kept one."""
    results = run_ranks(4, [str(tmp_path)], script="tests/deepspeed_ext/exact/local_replay_worker.py",
                        timeout=240)
    assert all(r.returncode == 0 for r in results), describe(results)
    out = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    assert [o["stage"] for o in out] == [0, 0, 1, 1]
    for o in out:
        (result,) = o["results"]
        assert result["failed"] == o["stage"]
        assert result["steps"] == ([3, 4] if o["stage"] == 1 else [5, 6])
        assert result["same_state"] and result["same_sends"], result
        # restored as a survivor's kept state is (deepspeed_ext.exact.survivor), after
        # checking that the engine takes it; a state lacking its fragments is refused
        assert result["misfit"] is None
        assert result["misfit_empty"].startswith("the carried state lacks "), result
        assert result["sends"] == 2 * 4  # 2 steps of 4 micro-batches
        # the tied gradient's and the norm's all-reduces, both over this rank's pair of
        # stages, in the two steps
        assert result["collectives"] == 2
        assert len(o["losses"]) == 7 and o["losses"] == out[0]["losses"]
        # the upstream log: steps 4-7 kept (4 retained), keyed by the real micro-batch
        # (stage 0 has 2 pipeline buffers for 4 micro-batches: keyed by buffer, 2-3 would
        # overwrite 0-1), one direction per stage, nothing of evaluation
        # (stage 0 lost its log of step 4 with its state, and replayed from step 5 on)
        direction, first = ("activation", 5) if o["stage"] == 0 else ("gradient", 4)
        assert o["held"] == [[s, m, direction] for s in range(first, 8) for m in range(4)]
        assert o["held_after_eval"] == len(o["held"])
        assert o["cross_steps"] == list(range(first, 8))
        # stage 0 sends (hidden fp32 [2, 16, 32], positions int64, aux fp32); stage 1 the
        # gradients of the two float tensors
        hidden = 2 * 16 * 32 * 4
        assert o["entry_bytes"] == [hidden + 2 * 16 * 8 + 4 if o["stage"] == 0 else hidden + 4]
        assert o["bytes"] == len(o["held"]) * o["entry_bytes"][0]
