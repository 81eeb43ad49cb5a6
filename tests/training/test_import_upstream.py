"""A Megatron-DeepSpeed MoE checkpoint (the fixture, written by upstream's own code)
imported with ``moc-ckpt import``: MoC's model loaded from it computes upstream's next
logged loss on upstream's samples, and MoC's trainer loads it and trains on."""

import json
import os
import shutil

import pytest
import torch

from deepspeed_ext.store.reader import CheckpointReader
from megatron.model.config import GPTMoEConfig
from megatron.model.gpt_moe import GPTMoEModel
from tests.deepspeed_ext.interop.upstream_samples import FIXTURE, train_samples
from tests.ds_world import deepspeed_world_of_one
from tests.launch import describe, run_ranks

UPSTREAM_FLAGS = [
    # The fixture run's settings (RECIPE.md, "The run") as MoC's trainer's flags.
    "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
    "--make-vocab-size-divisible-by", "128", "--num-experts", "4", "--expert-interval", "2",
    "--moe-expert-parallel-size", "2", "--topk", "1", "--moe-train-capacity-factor", "1.0",
    "--moe-min-capacity", "4", "--disable-moe-token-dropping", "--moe-loss-coeff", "0.01",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-beta1", "0.9",
    "--adam-beta2", "0.95", "--clip-grad", "1.0", "--zero-stage", "1", "--seed", "1234",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type",
    "ByteLevelTokenizer", "--split", "98,2,0", "--log-interval", "1", "--eval-interval",
    "1000", "--eval-iters", "1", "--moc-checkpoint"]

UPSTREAM_LOSSES = {7: 5.313589, 8: 5.252436, 9: 5.192067, 10: 5.115062}
"""Run B's lm loss per iteration after the checkpoint (logs/run_B_train10_nosave.losses.txt)."""


def upstream_loss(iteration: int) -> float:
    """Iteration ``iteration``'s lm loss as upstream logged it (run B's log line)."""
    with open(os.path.join(FIXTURE, "logs", "run_B_train10_nosave.losses.txt")) as f:
        for line in f:
            if line.split("|")[0].split()[1:2] == [f"{iteration}/"] or \
                    f"iteration {iteration:8d}/" in line:
                return float(line.split("lm loss:")[1].split("|")[0])
    raise AssertionError(f"no iteration {iteration} in run B's log")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from deepspeed_ext.cli.main import main
    out = tmp_path_factory.mktemp("imported") / "moc"
    assert main(["import", os.path.join(FIXTURE, "checkpoint"), "--out", str(out)]) == 0
    return str(out)


def _fixture_model() -> GPTMoEModel:
    config = GPTMoEConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, vocab_size=384, max_position_embeddings=64,
                          num_experts=4, expert_interval=2, moe_expert_parallel_size=1, topk=1,
                          moe_train_capacity_factor=1.0, moe_min_capacity=4,
                          moe_token_dropping=False, moe_loss_coeff=0.01, hidden_dropout=0.0,
                          attention_dropout=0.0)
    return GPTMoEModel(config)


def test_the_logged_losses_are_read_from_the_fixture():
    assert {i: upstream_loss(i) for i in UPSTREAM_LOSSES} == UPSTREAM_LOSSES


def test_moc_s_model_from_the_import_gives_upstream_s_next_loss(imported):
    """Iteration 7 after upstream's checkpoint at 6: samples 24-27, rank 0 the first two,
    rank 1 the last two; the logged loss is the two ranks' mean."""
    with deepspeed_world_of_one():
        model = _fixture_model()
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.set_deepspeed_parallelism()
        with CheckpointReader(imported) as reader, torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(reader.read_full(name, "fp32"))
        samples = train_samples(24, 4)
        position_ids = torch.arange(64).unsqueeze(0)
        losses = []
        with torch.no_grad():
            for rank in range(2):
                batch = samples[2 * rank:2 * rank + 2]
                lm_loss, _, _ = model(batch[:, :-1], position_ids.expand(2, -1), batch[:, 1:])
                losses.append(lm_loss.item())
    loss = sum(losses) / 2
    print(f"iteration 7: {loss:.7f} (ranks {losses[0]:.6f}, {losses[1]:.6f})")
    assert abs(loss - upstream_loss(7)) < 5e-6, (loss, losses)


def test_moc_s_trainer_continues_upstream_s_run_loss_for_loss(tmp_path):
    """``--load`` of upstream's directory imports it into ``--save``; two ranks, EP 2,
    ZeRO-1, on upstream's own .bin/.idx (its eod-less sizes read as upstream reads them)
    with Adam's L2 weight decay (upstream's optimizer on a CPU): iterations 7-10 log
    upstream's losses within fp32 noise, so the weights, Adam's moments and step, the
    schedule and the sample position all came over."""
    data = tmp_path / "data"
    data.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(os.path.join(FIXTURE, "data", "bytes_text_document" + ext), data)
    save = tmp_path / "moc"
    metrics = tmp_path / "metrics.jsonl"
    results = run_ranks(2, UPSTREAM_FLAGS + [
        "--data-path", str(data / "bytes_text_document"), "--data-cache-path",
        str(tmp_path / "cache"), "--load", os.path.join(FIXTURE, "checkpoint"), "--save",
        str(save), "--save-interval", "100", "--train-iters", "10", "--l2-weight-decay",
        "--metrics-file", str(metrics)])
    assert all(r.returncode == 0 for r in results), describe(results)
    assert "> imported Megatron-DeepSpeed checkpoint" in results[0].output
    assert "at iteration 6 (24 consumed samples)" in results[0].output
    assert {"global_step6", "global_step10"} <= set(os.listdir(save))
    assert "--l2-weight-decay" not in results[0].output  # no warning: the same optimizer
    with open(metrics) as f:
        losses = {r["iteration"]: r["lm_loss"] for r in map(json.loads, f)
                  if r.get("kind") == "train"}
    assert sorted(losses) == [7, 8, 9, 10]
    for iteration, loss in losses.items():
        assert abs(loss - UPSTREAM_LOSSES[iteration]) < 5e-6, (iteration, loss)
