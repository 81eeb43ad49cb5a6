"""Bringing a run over: ``--moc-checkpoint --load`` of a DeepSpeed-format checkpoint.

One baseline run (8 iterations, saved at 4 and 8) is shared by the tests: its losses of
iterations 5-8 are what a resume from its iteration-4 checkpoint gives (the baseline's
own resume is bitwise exact: tests/training/test_pretrain.py). A MoC run loads that
checkpoint, with its ``args`` rewritten to the dict older checkpoints stored, and must
train iterations 5-8 to the same losses, then write a MoC checkpoint that loads alone.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.launch import REPO, describe, run_ranks

TINY = ["--config", "configs/tiny.yaml", "--split", "90,10,0"]


def _train(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]  # loss, lr, grad norm


@pytest.fixture(scope="module")
def baseline(corpus, tmp_path_factory):
    """8 baseline iterations, checkpoints at 4 and 8, and a copy of the one at 4 alone."""
    out = tmp_path_factory.mktemp("baseline")
    results = run_ranks(2, TINY + ["--data-path", corpus, "--save", str(out / "ckpt"),
                                   "--save-interval", "4", "--metrics-file", str(out / "m.jsonl")])
    assert all(r.returncode == 0 for r in results), describe(results)
    return out


def test_a_baseline_checkpoint_is_what_megatron_deepspeed_tools_read(baseline):
    ckpt = baseline / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step8"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "8"
    state = torch.load(ckpt / "global_step8" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)  # this test's own run wrote it
    args = state["args"]
    assert isinstance(args, argparse.Namespace)
    # what Megatron-DeepSpeed's conversion tools and its loader's check read
    assert args.tensor_model_parallel_size == 1 and args.pipeline_model_parallel_size == 1
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 32, 4)
    assert args.max_position_embeddings == 32 and args.make_vocab_size_divisible_by == 8
    assert args.padded_vocab_size > 0 and args.tokenizer_type
    assert args.consumed_train_samples == 64 and args.iteration == 8
    assert sorted(p.name for p in (ckpt / "global_step8").iterdir()
                  if p.name.startswith("layer_")) == [
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0,) for e in range(4)]


def test_moc_resumes_from_a_deepspeed_checkpoint_with_the_baselines_losses(baseline, corpus,
                                                                          tmp_path):
    ds_dir = tmp_path / "ds"
    shutil.copytree(baseline / "ckpt" / "global_step4", ds_dir / "global_step4")
    (ds_dir / "latest").write_text("global_step4")
    model_file = ds_dir / "global_step4" / "mp_rank_00_model_states.pt"
    state = torch.load(model_file, map_location="cpu", weights_only=False)
    state["args"] = vars(state["args"])  # as checkpoints before the Namespace stored them
    torch.save(state, model_file)
    save, metrics = tmp_path / "moc", tmp_path / "m.jsonl"
    results = run_ranks(2, TINY + ["--data-path", corpus, "--moc-checkpoint", "--load", str(ds_dir),
                                   "--save", str(save), "--save-interval", "4",
                                   "--metrics-file", str(metrics)])
    assert all(r.returncode == 0 for r in results), describe(results)
    log = results[0].output
    assert "no checkpoint found" not in log
    assert "loading a DeepSpeed checkpoint" in log and "the next save writes a MoC checkpoint" in log
    assert "at iteration 4" in log
    assert _train(metrics) == _train(baseline / "m.jsonl")[4:]  # bitwise on CPU
    assert (save / "latest").read_text() == "global_step8"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "8"
    from deepspeed_ext.store.catalog import referenced_tags
    assert referenced_tags(str(save), "global_step8") == {"global_step8"}  # every expert in it
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "deepspeed_ext.cli", "verify", str(save)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
