"""Pipeline parallelism through the trainer (--pipeline-model-parallel-size): PP = 2 on 4
ranks against PP = 1 on 2 ranks, the same model, data and steps; and what is refused."""

import json
import re

import pytest

from tests.launch import describe, run_ranks

# every layer MoE: a stage without experts is refused (test_gpt_moe_pipe.py)
TINY = ["--config", "configs/tiny.yaml", "--split", "90,10,0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--train-iters", "6", "--eval-interval", "3",
        "--eval-iters", "1", "--log-interval", "1", "--topk", "1", "--expert-interval", "1",
        "--zero-stage", "1"]


def _records(path):
    with open(path) as f:
        return {(r["kind"], r["iteration"]): (r["lm_loss"], r.get("moe_aux_loss"), r.get("grad_norm"))
                for r in map(json.loads, f) if r["kind"] in ("train", "valid")}


def test_two_pipeline_stages_train_as_one(corpus, tmp_path):
    """ZeRO-1, 6 steps of 2 micro-batches, top-1: every logged LM loss, aux loss and
    gradient norm of PP = 2 (DeepSpeed's pipeline engine, each stage one decoder layer
    and 2 of the 4 experts per rank) agrees with PP = 1's within 1e-5 relative (measured:
    equal to 1e-7: the tied embedding's gradient is summed over two stages). The LM and
    aux losses, which the engine reports only summed, come from the last stage's loss
    function."""
    runs = {}
    for stages, nproc in ((1, 2), (2, 4)):
        metrics = tmp_path / f"pp{stages}.jsonl"
        results = run_ranks(nproc, TINY + ["--data-path", corpus, "--metrics-file", str(metrics),
                                           "--pipeline-model-parallel-size", str(stages)],
                            timeout=240)
        assert all(r.returncode == 0 for r in results), describe(results)
        runs[stages] = _records(metrics)
    assert runs[1].keys() == runs[2].keys() and len(runs[1]) == 6 + 2
    for key, want in runs[1].items():
        for got, value in zip(runs[2][key], want):
            if value is not None:
                assert got == pytest.approx(value, rel=1e-5), (key, runs[2][key], want)


@pytest.mark.parametrize("extra, needle", [
    (["--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size 2 with --zero-stage 2: DeepSpeed's pipeline engine supports "
     "ZeRO stage 0 or 1 only"),
    (["--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--moc-checkpoint"],
     "with --moc-checkpoint: MoC checkpoints of pipeline runs are not supported yet"),
    (["--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--tensor-model-parallel-size",
      "2", "--enable-expert-tensor-parallelism"], "tensor and pipeline parallelism together"),
    (["--pipeline-model-parallel-size", "3", "--zero-stage", "1"],
     "world size \\(4\\) must be divisible by --pipeline-model-parallel-size \\(3\\)"),
])
def test_what_pipeline_parallelism_does_not_support_is_refused(extra, needle):
    from tests.training.refusals import refusal
    # 8 ranks with tensor parallelism: a stage of 4 holds T 2 x EP 2
    assert re.search(needle, refusal(extra, 8 if "--tensor-model-parallel-size" in extra else 4))
