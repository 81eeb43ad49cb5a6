"""The importer's pieces on the upstream fixture (written by Megatron-DeepSpeed's own
code: tests/fixtures/megatron_deepspeed_moe/RECIPE.md): the weights-only load and its
allow-list, the name map and QKV order, the ZeRO partitions put back together, the
directory read whole, and the MoC checkpoint written from it."""

import argparse
import os
import pickle
import shutil

import pytest
import torch

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.interop import megatron_names as names
from deepspeed_ext.interop.moc_write import ImportLayout, plan_import, write_moc_checkpoint
from deepspeed_ext.interop.safe_load import load_upstream_file
from deepspeed_ext.interop.upstream import expert_file, read_upstream
from deepspeed_ext.interop.upstream_model import UpstreamModel, scheduler_in_iterations
from deepspeed_ext.store.reader import CheckpointReader
from deepspeed_ext.store.verify import verify_checkpoint
from tests.deepspeed_ext.interop.upstream_samples import FIXTURE

ROOT = os.path.join(FIXTURE, "checkpoint")
STEP = os.path.join(ROOT, "global_step6")
QKV = "layers.1.self_attention.query_key_value.weight"
EXPERT3 = "layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight"


@pytest.fixture(scope="module")
def upstream():
    return read_upstream(ROOT)


@pytest.fixture(scope="module")
def model_file():
    return load_upstream_file(ROOT, os.path.join(STEP, "mp_rank_00_model_states.pt"))


class Evil:
    def __reduce__(self):
        return (os.system, ("echo should never run",))


def test_every_fixture_file_loads_weights_only_and_a_pickled_call_is_refused(tmp_path):
    for name in sorted(os.listdir(STEP)):
        assert isinstance(load_upstream_file(ROOT, os.path.join(STEP, name)), dict), name
    bad = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, bad)
    with pytest.raises(CheckpointError, match="weights-only"):
        load_upstream_file(str(tmp_path), str(bad))
    with open(tmp_path / "plain.pt", "wb") as f:
        pickle.dump({"x": 1}, f, protocol=2)  # not a torch zip file
    with pytest.raises(CheckpointError, match="plain.pt"):
        load_upstream_file(str(tmp_path), str(tmp_path / "plain.pt"))


def test_a_link_or_a_path_outside_the_checkpoint_is_refused(tmp_path):
    os.symlink(os.path.join(STEP, "layer_0_expert_0_mp_rank_00_model_states.pt"),
               tmp_path / "link.pt")
    with pytest.raises(CheckpointError, match="outside"):
        load_upstream_file(str(tmp_path), str(tmp_path / "link.pt"))
    with pytest.raises(CheckpointError, match="outside"):
        load_upstream_file(str(tmp_path), os.path.join(STEP, expert_file(0, 0)))


def test_names_map_both_ways_and_the_stray_copies_are_dropped():
    up = "language_model.encoder.layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight"
    assert names.moc_name(up) == EXPERT3 and names.upstream_name(EXPERT3) == up
    assert names.moc_name("language_model.embedding.word_embeddings.weight") == "word_embeddings.weight"
    assert names.upstream_name("position_embeddings.weight") == \
        "language_model.embedding.position_embeddings.weight"
    assert names.moc_name("language_model.encoder.final_layernorm.bias") == "final_layernorm.bias"
    assert names.moc_name("encoderlayers.1.mlp.deepspeed_moe.experts.deepspeed_experts.0.dense_h_to_4h.weight") is None
    assert names.moc_name("language_model.output_layer.weight") == "output_layer.weight"
    assert names.upstream_name("output_layer.weight") == "language_model.output_layer.weight"
    with pytest.raises(ValueError, match="pooler"):
        names.moc_name("language_model.pooler.dense.weight")
    assert names.expert_of(EXPERT3) == (3, 3) and names.expert_of(QKV) is None


def test_qkv_rows_go_from_per_head_to_per_kind_and_back():
    heads, head_dim = 4, 16
    rows = torch.arange(3 * heads * head_dim, dtype=torch.float32)
    ours = names.qkv_to_moc(rows, heads)
    # MoC's row r of kind k (0 q, 1 k, 2 v) and head h is upstream's row 48h + 16k + d.
    for k in range(3):
        for h in range(heads):
            block = ours[(k * heads + h) * head_dim:(k * heads + h + 1) * head_dim]
            start = h * 3 * head_dim + k * head_dim
            assert torch.equal(block, torch.arange(start, start + head_dim, dtype=torch.float32))
    weight = torch.randn(192, 64)
    assert torch.equal(names.qkv_to_upstream(names.qkv_to_moc(weight, heads), heads), weight)
    with pytest.raises(ValueError, match="not 3 x"):
        names.qkv_to_moc(torch.zeros(10, 4), heads)


def test_zero_partitions_give_the_module_s_weights_and_each_expert_file_s(upstream, model_file):
    module = names.flatten_module(model_file["module"])
    assert upstream.source_weights == "zero" and upstream.group_steps == [6.0] * 4
    for up, tensor in module.items():
        ours = names.moc_name(up)
        if ours is None:
            continue
        expected = names.qkv_to_moc(tensor, 4) if names.is_qkv(ours) else tensor
        assert torch.equal(upstream.weights[ours], expected), ours  # fp32 run: equal
    for layer in range(2):
        for expert in range(4):
            saved = load_upstream_file(ROOT, os.path.join(STEP, expert_file(layer, expert)))
            for up, tensor in saved.items():
                assert torch.equal(upstream.weights[names.moc_name(up)], tensor), up
    assert len(upstream.weights) == 78 and len(upstream.moments) == 156
    # Adam's moments came along, rank 1's expert 3 (local 1) among them.
    assert upstream.moments[(EXPERT3, "exp_avg_sq")].abs().sum() > 0
    assert upstream.experts()[EXPERT3] == (1, 3)


def test_the_moments_follow_the_qkv_permutation(upstream):
    zero = load_upstream_file(ROOT, os.path.join(STEP, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    osd = zero["optimizer_state_dict"]
    address = osd["param_slice_mappings"][0]["language_model.encoder.layers.0.self_attention.query_key_value.weight"]
    flat = osd["base_optimizer_state"]["state"][0]["exp_avg"][address.start:address.start + address.numel]
    assert address.numel == 192 * 64  # whole on rank 0
    ours = upstream.moments[("layers.0.self_attention.query_key_value.weight", "exp_avg")]
    assert torch.equal(names.qkv_to_upstream(ours, 4).reshape(-1), flat)


def test_model_and_scheduler_come_from_the_stored_arguments(upstream, model_file):
    m = upstream.model
    assert (m.num_layers, m.hidden_size, m.num_experts, m.ep_size, m.dp_world_size,
            m.moe_layers, m.true_vocab_size) == (4, 64, 4, 2, 2, [1, 3], 257)
    sched = scheduler_in_iterations(model_file["lr_scheduler"], 4)
    assert (sched["num_steps"], sched["lr_decay_steps"], sched["lr_warmup_steps"]) == (6, 6, 0)
    assert "num_tokens" not in sched and sched["max_lr"] == 1e-3
    with pytest.raises(ValueError, match="max_lr"):
        scheduler_in_iterations({"num_steps": 4}, 4)


@pytest.mark.parametrize("fields,flag", [
    ({"mlp_type": "residual"}, "--mlp-type"), ({"num_experts": [4, 8]}, "--num-experts"),
    ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size"),
    ({"apply_residual_connection_post_layernorm": True}, "--apply-residual-connection"),
    ({"use_rotary_position_embeddings": True}, "both a learned position table"),
    ({"add_position_embedding": False}, "no position embedding at all"),
    ({"num_key_value_heads": 3}, "--num-key-value-heads 3")])
def test_architectures_moc_cannot_train_are_refused_by_name(model_file, fields, flag):
    args = argparse.Namespace(**dict(vars(model_file["args"]), **fields))
    with pytest.raises(ValueError, match=flag):
        UpstreamModel.from_args(args, model_file["universal_checkpoint_info"])


def test_today_s_architectures_are_read_from_the_stored_arguments(model_file):
    args = argparse.Namespace(**dict(
        vars(model_file["args"]), swiglu=True, normalization="rmsnorm", add_bias_linear=False,
        untie_embeddings_and_output_weights=True, num_key_value_heads=2,
        use_rotary_position_embeddings=True, add_position_embedding=False, rope_theta=1e6))
    m = UpstreamModel.from_args(args, model_file["universal_checkpoint_info"])
    assert (m.swiglu, m.normalization, m.add_bias_linear, m.untie, m.kv_heads, m.grouped,
            m.rotary, m.rope_theta) == (True, "rmsnorm", False, True, 2, True, True, 1e6)
    moc = m.moc_args()
    assert (moc["position_embedding_type"], moc["num_key_value_heads"],
            moc["use_rotary_position_embeddings"]) == ("rope", 2, True)


def test_a_missing_zero_file_is_named_and_weights_only_reads_none(tmp_path):
    shutil.copytree(ROOT, tmp_path / "ckpt")
    os.remove(tmp_path / "ckpt" / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        read_upstream(str(tmp_path / "ckpt"))
    only = read_upstream(str(tmp_path / "ckpt"), weights_only=True)
    assert only.source_weights == "module" and not only.moments and not only.group_steps
    os.remove(tmp_path / "ckpt" / "global_step6" / expert_file(1, 2))
    with pytest.raises(CheckpointError, match=expert_file(1, 2)):
        read_upstream(str(tmp_path / "ckpt"), weights_only=True)


def test_the_plan_keeps_experts_in_their_expert_parallel_group():
    meta = {("a", "fp32"): (400, None), ("b", "fp32"): (400, None),
            ("e0", "fp32"): (100, (0, 0)), ("e3", "fp32"): (100, (0, 3))}
    plan = plan_import(meta, ImportLayout(world_size=4, ep_size=2), num_experts=4)
    assert plan.writer["e0|fp32"] in (0, 2) and plan.writer["e3|fp32"] in (1, 3)
    with pytest.raises(ValueError, match="must divide"):
        plan_import(meta, ImportLayout(world_size=3, ep_size=2), num_experts=4)


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (1, 1)])
def test_the_written_checkpoint_verifies_and_reads_back_the_upstream_tensors(
        upstream, tmp_path, world, ep):
    out = str(tmp_path / "moc")
    write_moc_checkpoint(out, upstream, ImportLayout(world_size=world, ep_size=ep))
    assert verify_checkpoint(out, "global_step6", checksums=True) == []
    with CheckpointReader(out) as reader:
        assert reader.step == 6 and reader.manifest.layout["ep_size"] == ep
        for name, tensor in upstream.weights.items():
            assert torch.equal(reader.read_full(name, "fp32"), tensor), name
        for (name, kind), tensor in upstream.moments.items():
            assert torch.equal(reader.read_full(name, kind), tensor), (name, kind)
        objects = reader.objects()
    client = objects["client_state"]
    assert (client["iteration"], client["consumed_train_samples"]) == (6, 24)
    assert objects["optimizer_moments"] == [True] * 4
    assert objects["padded_vocab"]["real_rows"] == 257
    assert len(os.listdir(os.path.join(out, "global_step6"))) == world + 2  # + objects, manifest
