"""``moc-ckpt export --format megatron-deepspeed`` against upstream's own files: the
export of the fixture's import is the fixture again, tensor for tensor, and an export
imported again is the checkpoint it came from, bitwise, at any expert-parallel size."""

import os

import pytest
import torch

from deepspeed_ext.cli.main import main
from deepspeed_ext.interop.safe_load import load_upstream_file
from deepspeed_ext.interop.upstream import expert_file, read_upstream, zero_file
from tests.deepspeed_ext.interop.upstream_samples import FIXTURE

ROOT = os.path.join(FIXTURE, "checkpoint")
STEP = os.path.join(ROOT, "global_step6")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("import") / "moc")
    assert main(["import", ROOT, "--out", out]) == 0
    return out


def _export(src, out, *extra):
    return main(["export", src, "--format", "megatron-deepspeed", "--out", str(out), *extra])


def _load(root, name):
    return load_upstream_file(str(root), os.path.join(str(root), "global_step6", name))


def test_the_export_of_the_import_is_upstream_s_checkpoint_again(imported, tmp_path):
    assert _export(imported, tmp_path / "up") == 0
    ours, theirs = _load(tmp_path / "up", "mp_rank_00_model_states.pt"), _load(ROOT, "mp_rank_00_model_states.pt")
    enc = theirs["module"]["language_model"]["encoder"]
    assert list(ours["module"]["language_model"]["encoder"]) == list(enc)
    for key, tensor in ours["module"]["language_model"]["encoder"].items():
        assert torch.equal(tensor, enc[key]), key
    for key in ("word_embeddings", "position_embeddings"):
        assert torch.equal(ours["module"]["language_model"]["embedding"][key]["weight"],
                           theirs["module"]["language_model"]["embedding"][key]["weight"])
    assert [[(n, tuple(s)) for n, s in g.items()] for g in ours["param_shapes"]] == \
        [[(n, tuple(s)) for n, s in g.items()] for g in theirs["param_shapes"]]
    for key in ("iteration", "global_steps", "global_samples", "dp_world_size", "num_experts",
                "universal_checkpoint_info"):
        assert ours[key] == theirs[key], key
    for key in ("num_steps", "lr_decay_steps", "lr_warmup_steps", "max_lr", "min_lr"):
        assert ours["lr_scheduler"][key] == theirs["lr_scheduler"][key], key
    for field in ("num_layers", "hidden_size", "padded_vocab_size", "moe_expert_parallel_size",
                  "num_experts", "global_batch_size", "consumed_train_samples"):
        assert getattr(ours["args"], field) == getattr(theirs["args"], field), field
    for layer in range(2):
        for expert in range(4):
            a, b = _load(tmp_path / "up", expert_file(layer, expert)), _load(ROOT, expert_file(layer, expert))
            assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_zero_files_are_upstream_s_partitions(imported, tmp_path):
    assert _export(imported, tmp_path / "up") == 0
    for rank in range(2):
        a = _load(tmp_path / "up", zero_file(rank))["optimizer_state_dict"]
        b = _load(ROOT, zero_file(rank))["optimizer_state_dict"]
        for g in range(4):
            assert torch.equal(a["single_partition_of_fp32_groups"][g],
                               b["single_partition_of_fp32_groups"][g]), (rank, g)
            sa, sb = a["base_optimizer_state"]["state"][g], b["base_optimizer_state"]["state"][g]
            for kind in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[kind], sb[kind]), (rank, g, kind)
            assert [(n, x.start, x.numel) for n, x in a["param_slice_mappings"][g].items()] == \
                [(n, x.start, x.numel) for n, x in b["param_slice_mappings"][g].items()]
            pa, pb = (dict(x["base_optimizer_state"]["param_groups"][g]) for x in (a, b))
            for key in ("name", "wd_mult", "betas", "eps", "weight_decay", "decoupled_weight_decay",
                        "moe"):
                assert pa.get(key) == pb.get(key), (rank, g, key)
        for key in ("partition_count", "group_paddings", "zero_stage", "clip_grad"):
            assert a[key] == b[key], key


@pytest.mark.parametrize("ep,dp", [(2, 2), (4, 4), (1, 2)])
def test_an_export_imported_again_is_bitwise_the_checkpoint_it_came_from(imported, tmp_path, ep, dp):
    assert _export(imported, tmp_path / "up", "--expert-parallel-size", str(ep),
                   "--data-parallel-size", str(dp)) == 0
    assert len([n for n in os.listdir(tmp_path / "up" / "global_step6")
                if n.startswith("zero_pp_rank_")]) == dp
    first, again = read_upstream(ROOT), read_upstream(str(tmp_path / "up"))
    assert again.model.ep_size == ep
    assert first.weights.keys() == again.weights.keys()
    assert all(torch.equal(first.weights[n], again.weights[n]) for n in first.weights)
    assert first.moments.keys() == again.moments.keys()
    assert all(torch.equal(first.moments[k], again.moments[k]) for k in first.moments)
    assert (again.iteration, again.global_samples, again.group_steps, again.l2_weight_decay,
            again.adam) == (first.iteration, first.global_samples, first.group_steps,
                            first.l2_weight_decay, first.adam)
    for a, b in zip(first.rng_states, again.rng_states):
        assert torch.equal(a["torch"], b["torch"]) and list(a["python"][1]) == list(b["python"][1])


def test_bad_layouts_and_an_existing_directory_are_refused(imported, tmp_path, capsys):
    assert _export(imported, tmp_path / "up", "--expert-parallel-size", "3") == 2
    assert "--expert-parallel-size" in capsys.readouterr().err
    assert _export(imported, tmp_path / "up") == 0
    assert _export(imported, tmp_path / "up") == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_a_weights_only_checkpoint_exports_without_zero_files(tmp_path, capsys):
    assert main(["import", ROOT, "--out", str(tmp_path / "moc"), "--weights-only"]) == 0
    assert _export(str(tmp_path / "moc"), tmp_path / "up") == 0
    assert "weights only (no ZeRO files)" in capsys.readouterr().out
    names = os.listdir(tmp_path / "up" / "global_step6")
    assert not [n for n in names if n.startswith("zero_pp_rank_")] and len(names) == 9
    again = read_upstream(str(tmp_path / "up"))
    assert not again.moments and again.source_weights == "module"
    first = read_upstream(ROOT)
    assert all(torch.equal(first.weights[n], again.weights[n]) for n in first.weights)


def test_a_model_that_is_not_mixtral_s_is_not_exported_to_hugging_face(imported, tmp_path, capsys):
    assert main(["export", imported, "--format", "hf", "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "not a Mixtral-shaped model" in err and "--swiglu" in err and "--expert-interval 1" in err
    assert not (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10 ** 9), ("500MB", 5 * 10 ** 8),
                                       ("2GiB", 2 << 30), ("1000", 1000)])
def test_shard_sizes_read_as_people_write_them(text, size):
    from deepspeed_ext.cli.export_cmd import parse_size
    assert parse_size(text) == size


def test_a_bad_shard_size_is_a_usage_error(imported, tmp_path, capsys):
    assert main(["export", imported, "--format", "hf", "--out", str(tmp_path / "hf"),
                 "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size lots" in capsys.readouterr().err
