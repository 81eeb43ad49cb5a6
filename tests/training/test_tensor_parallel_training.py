"""Training with tensor parallelism through the trainer: T = 2 x E = 2 on 4 ranks, with
experts split over the tensor-parallel ranks and with experts replicated over them, against
T = 1 x E = 2 on 2 ranks, the same model, data and steps; MoC checkpoints loaded under
another tensor-parallel size (and another expert-parallel size, and another vocabulary
padding), consolidated; and what is refused. Recovery under tensor parallelism, to the
bit: from the peers' memory after a restart, and by exact replay in place, in
test_pipeline_training.py (PP 2 x TP 2)."""

import json
import re
import os
import subprocess

import pytest
import torch

from tests.launch import REPO, describe, run_ranks

TINY = ["--config", "configs/tiny.yaml", "--split", "90,10,0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--train-iters", "6", "--eval-interval", "3",
        "--eval-iters", "1", "--log-interval", "1", "--topk", "2"]


LAYOUTS = {
    # name: (ranks, flags). The vocabulary is padded to a multiple of
    # --make-vocab-size-divisible-by times the tensor-parallel size (as Megatron does):
    # configs/tiny.yaml's 8 pads 257 to 272 at T = 2 (and 264 at T = 1). The T = 1 run
    # pins 16 to pad to the same 272: the padding rows' logits enter the softmax, so the
    # layouts' losses compare only with equal paddings.
    "t1": (2, ["--make-vocab-size-divisible-by", "16"]),
    "t2": (4, ["--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism"]),
    # experts replicated over the tensor-parallel pair: DeepSpeed's world-ordered expert
    # groups, so each rank of a pair holds 2 of the 4 experts
    "t2-replicated": (4, ["--tensor-model-parallel-size", "2"]),
}


def _losses(path):
    with open(path) as f:  # a redone iteration's line replaces the first one's
        return {(r["kind"], r["iteration"]): (r["lm_loss"], r.get("grad_norm"))
                for r in map(json.loads, f) if r["kind"] in ("train", "valid")}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Every layout of :data:`LAYOUTS`, 6 steps each, with MoC checkpoints at 3 (every
    expert: the directory's first) and 6 (PEC, K = 2 of the 4 experts of the one MoE
    layer, the others' newest versions in step 3's):
    ``{layout: (losses, rank 0's log, save dir)}``."""
    out = {}
    for name, (nproc, flags) in LAYOUTS.items():
        where = tmp_path_factory.mktemp(name)
        results = run_ranks(nproc, TINY + flags + [
            "--data-path", corpus, "--metrics-file", str(where / "m.jsonl"), "--moc-checkpoint",
            "--save", str(where / "ckpt"), "--save-interval", "3", "--moc-pec-k", "2"],
            timeout=240)
        assert all(r.returncode == 0 for r in results), describe(results)
        out[name] = (_losses(where / "m.jsonl"), results[0].output, where / "ckpt")
    return out


@pytest.mark.parametrize("layout", ["t2", "t2-replicated"])
def test_tensor_parallel_training_tracks_the_single_rank_layers(runs, layout):
    """ZeRO-2, with DeepSpeed's expert sharding or with experts replicated over the
    tensor-parallel pair: every logged train and validation loss of 6 steps, and every
    gradient norm, agrees with the T = 1 run's within 1e-4 relative (measured: 9e-8).
    The runs differ only in float32 summation order (split matmuls summed by
    all-reduces), which Adam's updates carry into later steps; top-2's second-expert
    noise is drawn identically (the gate is replicated on every tensor-parallel rank and
    the generators start alike). Top-2 only: it also covers the gate's noise; top-1 is
    compared at model level (tests/model/test_tensor_parallel.py)."""
    (want, _, _), (got, log, _) = runs["t1"], runs[layout]
    assert want.keys() == got.keys() and len(want) == 6 + 2
    for key, (loss, grad_norm) in want.items():
        assert got[key][0] == pytest.approx(loss, rel=1e-4), (key, got[key], loss)
        # The norm gradient clipping uses (clip-grad 1.0). With split weights (or the
        # experts' deep copies of them) unmarked, DeepSpeed counted them on rank 0 only and
        # the norm was 1.2 %, then 0.15 %, low; with replicated experts unmarked it
        # missed the other rank's experts (1 % low). The losses did not show it.
        if key[0] == "train":
            assert got[key][1] == pytest.approx(grad_norm, rel=1e-4), (key, got[key], grad_norm)
    assert "tensor-parallel 2" in log
    # MoC's write plan spreads the checkpoint over the 4 ranks: "(max/mean 1.00)"
    balance = [float(line.split("max/mean ")[1].split(")")[0])
               for line in log.splitlines() if line.startswith("[moc] saved")]
    assert len(balance) == 2 and max(balance) < 1.1, balance


def _consolidated(ckpt, tag, out=None):
    """Every tensor of checkpoint ``tag``, whole, keyed as ``moc-ckpt consolidate
    --optimizer`` writes them: through the command when ``out`` is given (a process of
    its own: seconds of imports), else through the reader it uses."""
    if out is not None:
        from safetensors.torch import load_file
        subprocess.run([os.path.join(os.path.dirname(os.sys.executable), "moc-ckpt"),
                        "consolidate", str(ckpt), "--tag", tag, "--out", str(out), "--optimizer"],
                       check=True, capture_output=True, cwd=REPO)
        return load_file(str(out))
    from deepspeed_ext.store.reader import CheckpointReader
    with CheckpointReader(str(ckpt), tag) as reader:
        return {name if kind == "fp32" else f"{name}.{kind}": reader.read_full(name, kind)
                for name, kind in reader.keys()}


def test_moc_checkpoints_load_under_another_tensor_parallel_size(runs, corpus, tmp_path):
    """The step-3 checkpoint of a run, loaded by another layout, continues as that
    layout's own run did: T = 2 x E = 2 on 4 ranks -> T = 1 x E = 1 on 2 ranks;
    T = 1 x E = 2 -> T = 2 x E = 2; and experts replicated over the pair -> experts split
    over it. Losses of steps 4-6 within 1e-4 (the layouts' own tolerance; measured: 7e-8,
    about one float32 step of the loss). Every saved rank drew the same random stream, so
    the gate noise continues on another number of ranks (the log says so). A part laid in
    the wrong place (queries for keys, a row-parallel weight's columns) gives O(1)
    differences."""
    manifest = json.load(open(runs["t2"][2] / "global_step3" / "manifest.json"))
    qkv = manifest["tensors"]["layers.0.self_attention.query_key_value.weight|fp32"]
    assert qkv["shape"] == [96, 32] and qkv["split"] == {"view": [3, 32, 32], "dim": 1, "parts": 2}
    assert manifest["tensors"]["layers.0.input_layernorm.weight|fp32"].get("split") is None
    for saved, target, extra in (("t2", "t1", ["--moe-expert-parallel-size", "1"]),
                                 ("t1", "t2", []), ("t2-replicated", "t2", [])):
        load = _load_dir(tmp_path / f"{target}-from-{saved}", runs[saved][2], "global_step3")
        nproc, flags = LAYOUTS[target]
        results = run_ranks(nproc, TINY + flags + extra + [
            "--data-path", corpus, "--metrics-file", str(load / "m.jsonl"), "--moc-checkpoint",
            "--load", str(load)], timeout=240)
        assert all(r.returncode == 0 for r in results), describe(results)
        if LAYOUTS[saved][0] != nproc:
            assert "all equal: restored on each of the" in results[0].output
        got, want = _losses(load / "m.jsonl"), runs[target][0]
        assert sorted(got) == [("train", 4), ("train", 5), ("train", 6), ("valid", 6)]
        for key, (loss, _) in got.items():
            assert loss == pytest.approx(want[key][0], rel=1e-4), (saved, key, loss, want[key])
    # Consolidated, every layout's checkpoints give the same full tensors (the layouts'
    # float noise apart: Adam turns the near-zero gradients of the key bias into steps of
    # either sign, hence the absolute tolerance), weights and moments. Step 6 holds 2
    # experts per layer and takes the others from step 3 through its expert index (the
    # same experts in every layout: the same expert-parallel size).
    for tag in ("global_step3", "global_step6"):
        whole = {name: _consolidated(runs[name][2], tag) for name in runs}
        if tag == "global_step6":  # the command itself, once
            assert _consolidated(runs["t2"][2], tag, tmp_path / "t2.safetensors").keys() == \
                whole["t2"].keys()
        assert len(whole["t1"]) == 3 * 41
        for name in ("t2", "t2-replicated"):
            assert whole[name].keys() == whole["t1"].keys()
            for key, tensor in whole["t1"].items():
                scale = max(tensor.abs().max().item(), 1e-12)
                if key.endswith("exp_avg_sq"):  # squares of near-zero gradients
                    assert (whole[name][key] - tensor).abs().max() <= 1e-3 * scale, (name, key)
                else:
                    assert torch.allclose(whole[name][key], tensor, rtol=1e-4, atol=1e-5), \
                        (name, key)
    index = json.load(open(runs["t2"][2] / "global_step6" / "manifest.json"))["expert_index"]
    assert sorted(v["tag"] for v in index.values()) == ["global_step3"] * 2 + ["global_step6"] * 2


def _load_dir(where, ckpt, tag):
    """A new ``--load`` directory ``where`` holding only checkpoint ``tag`` of ``ckpt``
    (linked, so the runs' own directories stay as they are)."""
    os.makedirs(where)
    os.symlink(ckpt / tag, where / tag)
    (where / "latest").write_text(tag)
    return where


EMBEDDING = "word_embeddings.weight"
"""The model's padded-vocabulary tensor (also its output layer: tied)."""
KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _loaded_embedding(out, nproc, flags, load):
    """The word embedding's fp32 weights and Adam moments right after a MoC load of
    ``load`` into an engine of the trainer's model built with ``flags`` (nothing trained:
    tests/deepspeed_ext/engine_worker.py's ``load-resave``): ``{kind: [rows, hidden]}``."""
    out.mkdir()
    results = run_ranks(nproc, ["load-resave", str(out)] + flags + [
        "--load", str(load), "--save", str(out / "ckpt")],
        script="tests/deepspeed_ext/engine_worker.py", timeout=240)
    assert all(r.returncode == 0 for r in results), describe(results)
    state = json.loads((out / "rank0.json").read_text())["state_after_load"]
    return {kind: torch.tensor(state[f"{EMBEDDING}|{kind}"]).view(-1, 32) for kind in KINDS}


def _saved_embedding(ckpt, tag):
    from deepspeed_ext.store.reader import CheckpointReader
    with CheckpointReader(str(ckpt), tag) as reader:
        return {kind: reader.read_full(EMBEDDING, kind) for kind in KINDS}


def test_a_checkpoint_resumes_under_another_vocabulary_padding(runs, corpus, tmp_path):
    """TP 2 -> TP 1 -> TP 2 with configs/tiny.yaml's vocabulary flags, none added: the
    T = 2 run's step-3 checkpoint (257 tokens padded to 272 rows) resumes at T = 1 (264
    rows) for step 4; that run's checkpoint resumes at T = 2 (272 rows) for steps 5-6.
    Each load trims or adds padding rows of the word embedding (the tied output layer)
    and their Adam moments, and says so on rank 0.

    The losses track the uninterrupted T = 2 run, though not to the last digits: the
    padding rows' logits enter the softmax's denominator. Step 4 runs the same token rows
    without 8 padding rows, so its loss is lower, by ln(272 / 264) = 0.030 if every
    logit were equal (0.57 % of the loss): within 1e-2 relative (measured: 0.0289 lower,
    0.54 %). Steps 5-6 have the 272 rows again, 8 of them restarted at zero instead of
    trained down, after a step taken without them: within 2e-3 (measured: 7.4e-4 to
    8.4e-4). A token row lost or misplaced changes the loss by far more.

    The token rows are carried over bit for bit: the engine's weights and moments right
    after the T = 1 load (an engine of the trainer's model loading the same checkpoint
    without training) are the checkpoint's first rows."""
    losses, _, t2_ckpt = runs["t2"]
    first, second = tmp_path / "t1", tmp_path / "t2"
    at_t1 = run_ranks(2, TINY + [
        "--data-path", corpus, "--metrics-file", str(first / "m.jsonl"), "--moc-checkpoint",
        "--load", str(_load_dir(tmp_path / "t1-load", t2_ckpt, "global_step3")),
        "--save", str(first / "ckpt"), "--exit-interval", "4"], timeout=240)
    assert all(r.returncode == 0 for r in at_t1), describe(at_t1)
    assert ("vocabulary padding 272 -> 264 rows: trimmed 8 padding rows of "
            "word_embeddings.weight") in at_t1[0].output
    at_t2 = run_ranks(4, TINY + LAYOUTS["t2"][1] + [
        "--data-path", corpus, "--metrics-file", str(second / "m.jsonl"), "--moc-checkpoint",
        "--load", str(first / "ckpt")], timeout=240)
    assert all(r.returncode == 0 for r in at_t2), describe(at_t2)
    assert ("vocabulary padding 264 -> 272 rows: added 8 zero padding rows of "
            "word_embeddings.weight") in at_t2[0].output
    got = {**_losses(first / "m.jsonl"), **_losses(second / "m.jsonl")}
    assert sorted(got) == [("train", 4), ("train", 5), ("train", 6), ("valid", 6)]
    want = {key: loss for key, (loss, _) in losses.items()}
    assert 0 < want[("train", 4)] - got[("train", 4)][0] < 1e-2 * want[("train", 4)], got
    for key in (("train", 5), ("train", 6), ("valid", 6)):
        assert got[key][0] == pytest.approx(want[key], rel=2e-3), (key, got[key], want[key])
    # bit for bit: T = 2's step 3 loaded at T = 1 (the engine's own load; the rows T = 2
    # adds back, read as 1, 2 or 4 parts, at unit level: tests/deepspeed_ext/format/test_vocab.py)
    load = _load_dir(tmp_path / "state-t1-load", t2_ckpt, "global_step3")
    loaded = _loaded_embedding(tmp_path / "state-t1", 2, [], load)
    saved = _saved_embedding(t2_ckpt, "global_step3")
    for kind in KINDS:
        assert saved[kind].shape == (272, 32) and loaded[kind].shape == (264, 32), kind
        assert torch.equal(loaded[kind], saved[kind][:264]), kind


def test_the_trainer_refuses_another_vocabulary_and_names_the_padding_that_matches():
    """The trainer's check of a checkpoint's vocabulary (megatron/training/checkpointing.py,
    run on every rank before the load's first collective): a MoC checkpoint of the same
    tokens loads under another padding; another tokenizer is refused naming both
    tokenizers' flags; a checkpoint DeepSpeed loads, or one that records no vocabulary
    size, needs its own padding, and the message names the flag value that gives it."""
    import argparse
    from megatron.training.checkpointing import check_compatible
    from megatron.training.vocab_check import matching_divisor, vocab_refusal
    from megatron.errors import ConfigError
    here = argparse.Namespace(padded_vocab_size=264, true_vocab_size=257,
                              make_vocab_size_divisible_by=8, tensor_model_parallel_size=1,
                              tokenizer_type="ByteLevelTokenizer", vocab_file=None,
                              merge_file=None, moc_checkpoint=True)
    t2 = {"padded_vocab_size": 272, "true_vocab_size": 257, "make_vocab_size_divisible_by": 8,
          "tensor_model_parallel_size": 2, "tokenizer_type": "ByteLevelTokenizer"}
    assert vocab_refusal(t2, here, reshards=True) == ""
    assert vocab_refusal(dict(t2, padded_vocab_size=264), here, reshards=False) == ""
    assert vocab_refusal(t2, here, reshards=False) == (
        "was saved with its vocabulary padded to 272 rows (--make-vocab-size-divisible-by 8 x "
        "--tensor-model-parallel-size 2), this run pads it to 264 (--make-vocab-size-divisible-by "
        "8 x --tensor-model-parallel-size 1); DeepSpeed's checkpoints load only with their own "
        "padding (MoC checkpoints trim or add padding rows): add --make-vocab-size-divisible-by "
        "16, which pads this run's vocabulary to 272 rows at --tensor-model-parallel-size 1, or "
        "use another --load directory")
    unrecorded = {k: v for k, v in t2.items() if k != "true_vocab_size"}
    assert ("records no tokenizer vocabulary size (saved before it was recorded), so its "
            "padding rows cannot be told from its tokens: add --make-vocab-size-divisible-by 16"
            ) in vocab_refusal(unrecorded, here, reshards=True)
    gpt2 = dict(t2, padded_vocab_size=50304, true_vocab_size=50257,
                tokenizer_type="GPT2BPETokenizer", vocab_file="gpt2-vocab.json",
                merge_file="gpt2-merges.txt")
    for moc in (True, False):
        run = argparse.Namespace(**dict(vars(here), moc_checkpoint=moc))
        with pytest.raises(ConfigError) as err:
            check_compatible({"args": gpt2}, run, "ckpt/global_step6")
        assert str(err.value) == (
            "checkpoint ckpt/global_step6 was saved with a vocabulary of 50257 tokens "
            "(--tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file "
            "gpt2-merges.txt), this run's has 257 (--tokenizer-type ByteLevelTokenizer): only "
            "padding rows can be trimmed or added, so load it with the tokenizer it was saved "
            "with, or use another --load directory")
    # the saving run's multiple when it fits, else the smallest that does, else none
    assert matching_divisor(257, 272, 1, 8, 2) == 16 and matching_divisor(257, 264, 2, 8, 1) == 4
    assert matching_divisor(257, 264, 2) == 4 and matching_divisor(257, 384, 1) == 128
    assert matching_divisor(257, 256, 1) is None and matching_divisor(257, 273, 2) is None


@pytest.mark.parametrize("extra, needle", [
    (["--tensor-model-parallel-size", "2", "--moe-expert-parallel-size", "1"],
     "need --moe-expert-parallel-size \\(1\\) to be a multiple of --tensor-model-parallel-size"),
    (["--enable-expert-tensor-parallelism"], "needs --tensor-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "2", "--moe-expert-parallel-size", "2",
      "--moe-schedule", "parm-s1"], "--moe-schedule parm-s1 needs MoE layers"),
    (["--moe-schedule", "deepspeed", "--moe-schedule-costs", "c.json"],
     "--moe-schedule-costs is read by --moe-schedule auto only"),
    (["--tensor-model-parallel-size", "3", "--enable-expert-tensor-parallelism"],
     "--num-attention-heads \\(4\\) must be divisible by --tensor-model-parallel-size \\(3\\)"),
])
def test_what_tensor_parallelism_does_not_support_is_refused(extra, needle):
    from tests.training.refusals import refusal
    assert re.search(needle, refusal(extra, world_size=6 if "3" in extra else 4))


def test_moe_schedule_auto_installs_the_cheapest_predicted_schedule(runs, corpus, tmp_path):
    """--moe-schedule auto with --moe-schedule-costs: links whose tensor-parallel bytes
    are 100x dearer than the others make S1 the cheapest predicted schedule. The log names
    the choice with every prediction, and the run's losses and gradient norms match the T = 2
    run under DeepSpeed's schedule within 1e-4 (S1 sums the expert shards in another
    order; measured 1e-7). Equivalence per schedule and configuration is checked at layer
    level (tests/model/test_moe_schedules.py)."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"ep": {"alpha": 1e-6, "beta": 1e-10},
                                 "tp": {"alpha": 1e-6, "beta": 1e-8},
                                 "combined": {"alpha": 1e-6, "beta": 1e-10}}))
    results = run_ranks(4, TINY + LAYOUTS["t2"][1] + [
        "--data-path", corpus, "--metrics-file", str(tmp_path / "m.jsonl"),
        "--moe-schedule", "auto", "--moe-schedule-costs", str(costs)], timeout=240)
    assert all(r.returncode == 0 for r in results), describe(results)
    assert "> MoE schedule of layers.1.mlp: parm-s1 (predicted communication per pass: " \
        "deepspeed " in results[0].output
    got, want = _losses(tmp_path / "m.jsonl"), runs["t2"][0]
    assert got.keys() == want.keys()
    for key, (loss, grad_norm) in want.items():
        assert got[key][0] == pytest.approx(loss, rel=1e-4), (key, got[key], loss)
        if key[0] == "train":
            assert got[key][1] == pytest.approx(grad_norm, rel=1e-4), (key, got[key], grad_norm)
