"""A Mixtral-shaped model through the trainer (configs/mixtral-tiny.yaml: SwiGLU experts
in every layer, top-2 without second-expert noise or token dropping, RMSNorm, no biases,
an untied output layer, grouped-query attention, upstream's rotary embedding): the same
losses at T = 1 x E = 2, T = 2 x E = 2 (experts split over the tensor-parallel pair) and
PP = 2; its MoC checkpoints read as the same whole tensors whatever layout saved them,
and a T = 2 checkpoint resumed at T = 1 continues as the T = 1 run did."""

import json

import pytest
import torch

from deepspeed_ext.store.reader import CheckpointReader
from tests.launch import describe, run_ranks

MIXTRAL = ["--config", "configs/mixtral-tiny.yaml", "--split", "90,10,0", "--lr-decay-iters", "8",
           "--eval-interval",
           "3", "--moc-checkpoint", "--save-interval", "3", "--moc-pec-k", "2"]
LAYOUTS = {
    # name: (ranks, flags, iterations). T = 1 pads the vocabulary as T = 2 does (272 rows:
    # 257 tokens to a multiple of 8 x 2): the padding rows' logits enter the softmax.
    "t1": (2, ["--make-vocab-size-divisible-by", "16"], 8),
    "t2": (4, ["--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism"], 6),
    "pp2": (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                "--make-vocab-size-divisible-by", "16"], 6),
}


def _losses(path):
    with open(path) as f:
        return {(r["kind"], r["iteration"]): (r["lm_loss"], r.get("grad_norm"))
                for r in map(json.loads, f) if r["kind"] in ("train", "valid")}


def _whole(ckpt, tag):
    with CheckpointReader(str(ckpt), tag) as reader:
        return {(name, kind): reader.read_full(name, kind) for name, kind in reader.keys()}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    out = {}
    for name, (nproc, flags, iters) in LAYOUTS.items():
        where = tmp_path_factory.mktemp(name)
        results = run_ranks(nproc, MIXTRAL + flags + [
            "--data-path", corpus, "--train-iters", str(iters), "--metrics-file",
            str(where / "m.jsonl"), "--save", str(where / "ckpt")], timeout=240)
        assert all(r.returncode == 0 for r in results), describe(results)
        out[name] = (_losses(where / "m.jsonl"), where / "ckpt")
    return out


@pytest.mark.parametrize("layout", ["t2", "pp2"])
def test_every_layout_trains_the_same_model(runs, layout):
    """Losses and gradient norms of 6 steps within 1e-4 relative of T = 1's: a split in
    the wrong place (a rank's gate rows with another's up rows, queries of one key-value
    group with another's keys) would differ at O(1)."""
    want, got = runs["t1"][0], runs[layout][0]
    assert len(got) == 6 + 2
    for key, (loss, grad_norm) in got.items():
        assert loss == pytest.approx(want[key][0], rel=1e-4), (key, loss, want[key])
        if key[0] == "train" and grad_norm is not None:
            assert grad_norm == pytest.approx(want[key][1], rel=1e-4), (key, grad_norm)


def test_checkpoints_hold_the_same_whole_tensors_in_every_layout(runs):
    """Step 3 (every expert): each layout's checkpoint, read whole, is the same model and
    optimizer state (float noise apart), the new tensors included: the untied output
    layer, SwiGLU's [gate; up] rows, the grouped QKV rows, the RMSNorm weights."""
    whole = {name: _whole(runs[name][1], "global_step3") for name in LAYOUTS}
    ref = whole["t1"]
    names = {n for n, _ in ref}
    assert {"output_layer.weight", "layers.1.self_attention.query_key_value.weight",
            "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight"} <= names
    assert ref[("layers.1.self_attention.query_key_value.weight", "fp32")].shape == (64, 32)
    assert ref[("layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight",
                "fp32")].shape == (128, 32)
    assert not [n for n in names if n.endswith(".bias")]
    for layout in ("t2", "pp2"):
        assert whole[layout].keys() == ref.keys(), layout
        for key, tensor in ref.items():
            assert torch.allclose(whole[layout][key], tensor, rtol=1e-3, atol=1e-6), (layout, key)


def test_a_t2_checkpoint_continues_at_t1(runs, corpus, tmp_path):
    """T = 2's step-3 checkpoint (every expert) loaded by 2 ranks at T = 1: iterations 4-8
    as T = 1's own run logged them, within 1e-4 (its step 6 would not do: PEC saved 2 of
    the 4 experts there, and the others' step-3 versions lose 3 steps of their training)."""
    load = tmp_path / "load"
    load.mkdir()
    (load / "global_step3").symlink_to(runs["t2"][1] / "global_step3")
    (load / "latest").write_text("global_step3")
    nproc, flags, _ = LAYOUTS["t1"]
    results = run_ranks(nproc, MIXTRAL + flags + [
        "--data-path", corpus, "--train-iters", "8", "--metrics-file", str(tmp_path / "m.jsonl"),
        "--load", str(load), "--save", str(tmp_path / "save")], timeout=240)
    assert all(r.returncode == 0 for r in results), describe(results)
    got, want = _losses(tmp_path / "m.jsonl"), runs["t1"][0]
    assert sorted(k[1] for k in got if k[0] == "train") == [4, 5, 6, 7, 8]
    for key, (loss, _) in got.items():
        assert loss == pytest.approx(want[key][0], rel=1e-4), (key, loss, want[key])


def _our_model(ckpt, tag):
    """MoC's model (one rank, every expert local) holding checkpoint ``tag``'s weights, in
    evaluation mode, and the trainer arguments it was saved with."""
    from megatron.model.config import GPTMoEConfig
    from megatron.model.gpt_moe import GPTMoEModel
    with CheckpointReader(str(ckpt), tag) as reader:
        args = reader.objects()["client_state"]["args"]
        config = GPTMoEConfig(
            num_layers=args["num_layers"], hidden_size=args["hidden_size"],
            num_attention_heads=args["num_attention_heads"], vocab_size=args["padded_vocab_size"],
            max_position_embeddings=args["max_position_embeddings"],
            ffn_hidden_size=args["ffn_hidden_size"], position_embedding_type="rope",
            num_experts=args["num_experts"], expert_interval=1, topk=2,
            moe_token_dropping=False, hidden_dropout=0.0, attention_dropout=0.0,
            layernorm_epsilon=args["layernorm_epsilon"], swiglu=True, normalization="rmsnorm",
            add_bias_linear=False, untie_embeddings_and_output_weights=True,
            num_key_value_heads=args["num_key_value_heads"], rotary_interleaved=False,
            rope_theta=args["rope_theta"], moe_top2_2nd_expert_sampling=False,
            moe_eval_capacity_factor=1.0)
        model = GPTMoEModel(config)
        for layer in model.layers:
            layer.mlp.set_deepspeed_parallelism()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(reader.read_full(name, "fp32"))
    return model.eval()


def test_the_hugging_face_export_gives_the_same_logits_in_transformers(runs, tmp_path):
    """T = 2's step-6 checkpoint (tensor-parallel pieces, PEC's expert versions) exported
    with ``moc-ckpt export --format hf``, loaded by ``transformers``' MixtralForCausalLM on
    the CPU: its logits on 2 sequences of 32 tokens equal MoC's model's within 1e-4."""
    transformers = pytest.importorskip("transformers")  # the test extra installs it
    from deepspeed_ext.cli.main import main
    from tests.ds_world import deepspeed_world_of_one
    out = tmp_path / "hf"
    assert main(["export", str(runs["t2"][1]), "--format", "hf", "--out", str(out),
                 "--max-shard-size", "100KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    hf = transformers.MixtralForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with deepspeed_world_of_one():
        ours = _our_model(runs["t2"][1], "global_step6")
        with torch.no_grad():
            want = ours(tokens, torch.arange(32).expand(2, -1))
    with torch.no_grad():
        got = hf(input_ids=tokens).logits
    assert got.shape == want.shape == (2, 32, 272)
    print("max |logit difference|", float((got - want).abs().max()))
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_the_megatron_deepspeed_export_round_trips_bitwise(runs, tmp_path):
    """T = 2's step-3 checkpoint exported to upstream's layout (an output layer of its own,
    no position table, no biases, RMSNorm weights, SwiGLU's doubled rows, the grouped QKV
    rows) and imported again: every weight and moment as the MoC checkpoint holds it."""
    from deepspeed_ext.cli.main import main
    from deepspeed_ext.interop.safe_load import load_upstream_file
    up, again = tmp_path / "up", tmp_path / "again"
    assert main(["export", str(runs["t2"][1]), "--tag", "global_step3", "--format",
                 "megatron-deepspeed", "--out", str(up)]) == 0
    state = load_upstream_file(str(up), str(up / "global_step3" / "mp_rank_00_model_states.pt"))
    lm = state["module"]["language_model"]
    assert list(lm) == ["embedding", "encoder", "output_layer"]
    assert list(lm["embedding"]) == ["word_embeddings"]
    assert not [k for k in lm["encoder"] if k.endswith(".bias")]
    assert lm["encoder"]["layers.0.self_attention.query_key_value.weight"].shape == (64, 32)
    args = state["args"]
    assert (args.swiglu, args.normalization, args.num_key_value_heads,
            args.use_rotary_position_embeddings, args.add_position_embedding) == \
        (True, "rmsnorm", 2, True, False)
    assert main(["import", str(up), "--out", str(again)]) == 0
    first, second = _whole(runs["t2"][1], "global_step3"), _whole(again, "global_step3")
    assert first.keys() == second.keys()
    for key, tensor in first.items():
        assert torch.equal(second[key], tensor), key
