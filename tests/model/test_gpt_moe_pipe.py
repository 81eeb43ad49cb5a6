"""The GPT-MoE model as a DeepSpeed PipelineModule (megatron/model/gpt_moe_pipe.py): two
stages of ZeRO-1 training against the whole model, and the partitions it refuses."""

import json

import pytest

from megatron.model.config import GPTMoEConfig
from megatron.model.gpt_moe_pipe import check_stages_hold_experts
from tests.launch import describe, run_ranks


@pytest.mark.parametrize("layout", [
    # (layers, expert-parallel size, [(stages, ranks), ...])
    (2, 2, [(1, 2), (2, 4)]),
    # middle stages: they receive activations and gradients (the aux loss's included)
    (4, 1, [(1, 1), (4, 4)]),
])
def test_stages_train_as_the_whole_model(tmp_path, layout):
    """2 layers, both MoE (4 experts, expert parallelism 2 inside each stage), top-1,
    3 steps of 2 micro-batches: PP = 2 on 4 ranks (the pipeline engine's train_batch)
    against PP = 1 on 2 ranks (forward/backward/step per micro-batch); and 4 layers as
    PP = 4 on 4 ranks against one rank (with the int64 position ids before the aux loss
    between stages, the middle stages took its gradient as int64 garbage). The same
    micro-batches per data-parallel rank. Every step's loss agrees within 1e-5 relative
    (measured: equal). The stages start from the whole model's weights (each parameter
    drawn by its GPTMoEModel name); the tied output embedding's gradient is summed over
    the first and last stage. Top-1 only: top-2's second-expert noise is drawn from each
    stage's own generator, so a pipeline samples other noise than the whole model."""
    layers, ep, runs_of = layout
    losses = {}
    for stages, nproc in runs_of:
        out = tmp_path / f"pp{stages}"
        out.mkdir()
        results = run_ranks(nproc, [str(out), str(stages), "1", "1", str(layers), str(ep)],
                            script="tests/model/pipe_worker.py", timeout=180)
        assert all(r.returncode == 0 for r in results), describe(results)
        runs = [json.load(open(out / f"rank{r}.json")) for r in range(nproc)]
        assert all(run["losses"] == runs[0]["losses"] for run in runs)  # every rank reports it
        assert sorted({run["stage"] for run in runs}) == list(range(stages))
        losses[stages] = runs[0]["losses"]
    assert len(losses[1]) == 3 and losses[1][0] != losses[1][2]
    stages = runs_of[1][0]
    assert losses[stages] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.parametrize("interval, parts, ok", [
    (1, [0, 2, 5], True),           # layers 0 | 1, both MoE
    (2, [0, 2, 5], False),          # layer 0 dense alone on stage 0
    (2, [0, 3, 7], True),           # 4 layers: 0-1 | 2-3, MoE at 1 and 3
])
def test_every_stage_must_hold_an_moe_layer(interval, parts, ok):
    """A stage without experts has one optimizer parameter group fewer: DeepSpeed's ZeRO
    then leaves the other stages waiting in the gradient norm's all-reduce (measured: the
    job hung), so the partition is refused, naming the stage and the flags."""
    config = GPTMoEConfig(num_layers=parts[-1] - 3, hidden_size=32, num_attention_heads=4,
                          vocab_size=64, max_position_embeddings=16, num_experts=4,
                          moe_expert_parallel_size=2, expert_interval=interval)
    if ok:
        check_stages_hold_experts(config, parts)
    else:
        with pytest.raises(ValueError, match="stage 0 holds transformer layers \\[0\\] and no MoE "
                                             "layer.*--expert-interval \\(2\\)"):
            check_stages_hold_experts(config, parts)
