"""Upstream logging (deepspeed_ext.exact.upstream): a stage's log holds, per step and
micro-batch, exactly what its neighbour received; it keeps only the retained steps and
nothing of evaluation; the sizing functions."""

import json

from deepspeed_ext.exact.upstream import log_bytes_per_iteration, log_capacity_bytes
from tests.launch import describe, run_ranks


def test_each_stage_logs_what_its_neighbour_received(tmp_path):
    """2 stages on 2 ranks, 3 steps of 4 micro-batches (the engine reuses its 2 buffers on
    stage 0), retention 2 steps, then an evaluation batch. Stage 0 logs the activations
    of micro-batches 0-3 of steps 2 and 3; stage 1 the input gradients; every logged send
    equals what the other stage received, bit for bit (keyed by the real micro-batch:
    keyed by buffer, micro-batches 2-3 would overwrite 0-1); evaluation adds nothing."""
    results = run_ranks(2, [str(tmp_path)], script="tests/deepspeed_ext/exact/upstream_worker.py",
                        timeout=180)
    assert all(r.returncode == 0 for r in results), describe(results)
    out = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for rank, direction in ((0, "activation"), (1, "gradient")):
        want = [[step, micro, direction] for step in (2, 3) for micro in range(4)]
        assert out[rank]["keys"] == want, (rank, out[rank]["keys"])
        assert out[rank]["after_eval"] == want
        # the other stage received these (and 3 steps in all), and each is equal
        assert out[1 - rank]["other_logged"] == 8 and out[1 - rank]["matched"] == 8, out
        assert out[1 - rank]["received_steps"] == [1, 2, 3]
        assert len(out[rank]["entry_bytes"]) == 1
        assert out[rank]["bytes"] == 8 * out[rank]["entry_bytes"][0]
        assert out[rank]["peak"] == 12 * out[rank]["entry_bytes"][0]  # 3 steps before a free
    # stage 0 sends (hidden fp32, positions int64, aux fp32); stage 1 the gradients of
    # the two float tensors: hidden and aux
    hidden = 2 * 16 * 32 * 4
    assert out[0]["entry_bytes"] == [hidden + 2 * 16 * 8 + 4]
    assert out[1]["entry_bytes"] == [hidden + 4]


def test_log_sizes():
    assert log_bytes_per_iteration(100, 60, 4, stage=0, stages=3) == 400
    assert log_bytes_per_iteration(100, 60, 4, stage=1, stages=3) == 640
    assert log_bytes_per_iteration(100, 60, 4, stage=2, stages=3) == 240
    assert log_capacity_bytes(640, 6) == 7 * 640
