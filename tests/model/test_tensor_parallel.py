"""Tensor parallelism in the model: which tensors are split and how (pure), and a 2-rank
T = 2 model that starts from the T = 1 model's weights and computes its loss and
gradients (megatron-core's parallel layers on gloo)."""

import json

import pytest
import torch

from megatron.model.config import GPTMoEConfig
from megatron.model.tensor_parallel import TPSplit, split_of
from tests.launch import describe, run_ranks


def test_splits_of_the_models_tensors():
    assert split_of("layers.0.self_attention.dense.weight", (8, 4), 1) is None
    assert split_of("word_embeddings.weight", (32, 8), 2) == TPSplit((64, 8), (64, 8), 0)
    assert split_of("layers.0.mlp.dense_h_to_4h.bias", (16,), 2) == TPSplit((32,), (32,), 0)
    assert split_of("layers.0.mlp.dense_4h_to_h.weight", (8, 16), 2) == TPSplit((8, 32), (8, 32), 1)
    assert split_of("layers.0.mlp.dense_4h_to_h.bias", (8,), 2) is None  # row-parallel bias
    assert split_of("layers.0.input_layernorm.weight", (8,), 2) is None
    assert split_of("layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.0.dense_h_to_4h.weight",
                    (32, 8), 2) is None
    qkv = split_of("layers.0.self_attention.query_key_value.weight", (12, 8), 2)
    assert qkv == TPSplit((24, 8), (3, 8, 8), 1)


def test_a_qkv_slice_keeps_each_ranks_heads_for_q_k_and_v():
    """Rows of the fused QKV are [3, heads, head_dim]: rank r's piece holds q, k and v of
    its own heads, in that order, each a slice along the heads."""
    split = TPSplit((12, 1), (3, 4, 1), 1)  # hidden 4 (4 heads of 1), 3 * 4 rows
    full = torch.arange(12.0).reshape(12, 1)
    assert split.slice(full, 0, 2).flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert split.slice(full, 1, 2).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert split.offset(1, 2) == 2
    with pytest.raises(ValueError, match="global shape"):
        split.slice(torch.zeros(6, 1), 0, 2)


@pytest.mark.parametrize("kw, needle", [
    (dict(tensor_model_parallel_size=3), "--num-attention-heads \\(4\\) must be divisible"),
    (dict(tensor_model_parallel_size=2, vocab_size=63), "--vocab-size \\(63\\) must be divisible"),
])
def test_tensor_parallel_config_checks(kw, needle):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                max_position_embeddings=16)
    with pytest.raises(ValueError, match=needle):
        GPTMoEConfig(**{**base, **kw})


def test_two_ranks_compute_the_loss_and_gradients_of_the_whole_model(tmp_path):
    """T = 2 on 2 ranks against T = 1 on each rank: weights are exact slices (the same
    draws); loss and gradients differ only by the order of float32 sums (a matmul split
    in two halves summed by an all-reduce), so 1e-5 relative to the largest gradient."""
    results = run_ranks(2, [str(tmp_path)], script="tests/model/tp_worker.py", timeout=180)
    assert all(r.returncode == 0 for r in results), describe(results)
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["size"] == 2
        assert r["weight_diff"] == 0.0
        # Split parameters carry megatron-core's tensor_model_parallel / partition_dim
        # marks (DeepSpeed's gradient norm counts unmarked ones on rank 0 only).
        assert r.get("marked_wrong", []) == [], r["marked_wrong"]
        assert abs(r["loss1"] - r["loss2"]) <= 1e-5 * abs(r["loss1"]), r
        assert r["grad_diff"] <= 1e-5 * r["grad_scale"], r
        # Attention, MLP and vocabulary split; LayerNorms and row biases replicated.
        assert any("query_key_value.weight" in n for n in r["split"])
        assert "word_embeddings.weight" in r["split"]
        assert any("dense_4h_to_h.bias" in n for n in r["replicated"])


def _worker_runs(tmp_path, topk, layouts):
    """Run tests/model/tp_moe_worker.py for each ``(T, ranks, extra args)``: ``{T: [each
    rank's saved record]}``."""
    out = {}
    for size, nproc, extra in layouts:
        where = tmp_path / f"t{size}"
        where.mkdir()
        results = run_ranks(nproc, [str(where), str(size), str(topk)] + extra,
                            script="tests/model/tp_moe_worker.py", timeout=180)
        assert all(r.returncode == 0 for r in results), describe(results)
        out[size] = [torch.load(where / f"rank{r}.pt", weights_only=True) for r in range(nproc)]
    return out


def _odd_capacity_checked(drop, topk, ref_run, run, expert_tp):
    """Without token dropping the tokens were drawn so that the capacity the gate sizes
    (the largest expert count) is odd: T = 1 runs on it, T = 2 pads it to the next even
    number (megatron/model/moe_capacity.py; with replicated experts DeepSpeed's gate pads
    it itself). Returns True when the run was such a case."""
    if drop:  # a static capacity (8 with top-1, 16 with top-2): even, nothing to pad
        assert run["capacity"][0] == run["capacity"][1] == 8 * topk, run["capacity"]
        return False
    largest = ref_run["largest_count"]
    assert largest % 2 == 1 and run["largest_count"] == largest, (largest, run["largest_count"])
    assert ref_run["capacity"] is None  # T = 1: no padding installed
    if expert_tp:  # the gate's all-reduced capacity (over both data shards), then padded
        assert run["capacity"] == (largest, largest + 1), run["capacity"]
    assert run["capacity"][1] % 2 == 0
    return True


@pytest.mark.parametrize("topk", [1, 2])
def test_moe_layers_with_expert_tensor_parallelism_match_one_rank_per_layer(tmp_path, topk):
    """T = 2 x E = 2 on 4 ranks (experts split over the tensor-parallel pair, DeepSpeed's
    expert sharding) against T = 1 x E = 2 on 2 ranks, data-parallel rank d reading the
    same tokens in both: every loss, routing count and gradient (a slice of the T = 1
    one) agrees within 1e-5 of its scale; only float32 summation order differs. With
    token dropping and without it (on an odd capacity, which T = 2 pads), under every
    MoE schedule (DeepSpeed's, Parm's S1 and S2)."""
    from megatron.model.moe_schedules import SCHEDULES
    from megatron.model.tensor_parallel import split_of
    runs = _worker_runs(tmp_path, topk, ((1, 2, []), (2, 4, [])))
    ref = {r["dp_rank"]: r for r in runs[1]}
    split_names = odd = 0
    for got in runs[2]:
        want = ref[got["dp_rank"]]
        assert got["ep_rank"] == want["ep_rank"]
        assert sorted(got["runs"]) == sorted((drop, s) for drop in (False, True) for s in SCHEDULES)
        for (drop, schedule), run in got["runs"].items():
            case = (drop, schedule)
            ref_run = want["runs"][(drop, "deepspeed")]
            odd += _odd_capacity_checked(drop, topk, ref_run, run, expert_tp=True)
            assert torch.allclose(run["loss"], ref_run["loss"], rtol=1e-5, atol=0), case
            assert torch.allclose(run["aux"], ref_run["aux"], rtol=1e-5, atol=0), case
            assert torch.equal(run["counts"], ref_run["counts"]), case  # the same routing
            assert run["grads"].keys() == ref_run["grads"].keys()
            for name, grad in run["grads"].items():
                split = split_of(got["local_names"][name], tuple(grad.shape), 2, expert_tp=True)
                full = ref_run["grads"][name]
                expected = split.slice(full, got["tp_rank"], 2) if split else full
                split_names += split is not None
                assert got["marked"][name] == (split is not None), name
                scale = full.abs().max().item()
                assert (grad - expected).abs().max().item() <= 1e-5 * max(scale, 1e-12), (case, name)
    assert odd == 4 * len(SCHEDULES)  # every rank, every schedule, without token dropping
    assert split_names > 4 * 6 * 10  # attention, MLP, embedding and every expert's MLP split


@pytest.mark.parametrize("topk", [1, 2])
def test_moe_layers_with_replicated_experts_match_one_rank_per_layer(tmp_path, topk):
    """T = 2 x E = 2 on 4 ranks with experts replicated over the tensor-parallel pair
    (DeepSpeed's world-ordered expert groups: the pair's two ranks hold different
    experts, each gets the pair's capacity shares) against T = 1 x E = 2 on 2 ranks, with
    token dropping and without it (on an odd capacity): losses and routing agree; split
    tensors' gradients are slices of T = 1's; an expert's gradient summed over the ranks
    holding it (what its data-parallel all-reduce adds) is T = 1's summed the same way,
    within 1e-5 of its scale. Experts are whole and marked ``model_parallel`` only
    (DeepSpeed's norm then counts them on every rank)."""
    from megatron.model.tensor_parallel import split_of
    runs = _worker_runs(tmp_path, topk, ((1, 2, []), (2, 4, ["replicated"])))
    ref, got = runs[1], runs[2]
    assert [g["ep_rank"] for g in got] == [0, 1, 0, 1]  # the pair holds both halves

    def summed(ranks, case, name):
        return sum(r["runs"][case]["grads"][name] for r in ranks
                   if name in r["runs"][case]["grads"])

    experts = odd = 0
    for g in got:
        want = ref[g["dp_rank"]]
        assert sorted(g["runs"]) == [(False, "deepspeed"), (True, "deepspeed")]
        for case, run in g["runs"].items():
            ref_run = want["runs"][case]
            odd += _odd_capacity_checked(case[0], topk, ref_run, run, expert_tp=False)
            assert torch.allclose(run["loss"], ref_run["loss"], rtol=1e-5, atol=0), case
            assert torch.equal(run["counts"], ref_run["counts"]), case
            for name, grad in run["grads"].items():
                if "deepspeed_experts" in name:
                    experts += 1
                    assert g["model_parallel"][name] and not g["marked"][name], name
                    full = summed(ref, case, name)
                    diff = (summed(got, case, name) - full).abs().max().item()
                    assert diff <= 1e-5 * max(full.abs().max().item(), 1e-12), (case, name)
                    continue
                split = split_of(g["local_names"][name], tuple(grad.shape), 2, expert_tp=False)
                full = ref_run["grads"][name]
                expected = split.slice(full, g["tp_rank"], 2) if split else full
                scale = max(full.abs().max().item(), 1e-12)
                assert (grad - expected).abs().max().item() <= 1e-5 * scale, (case, name)
    assert odd == 4  # every rank, without token dropping
    assert experts == 2 * 4 * 2 * 4  # 2 cases x 4 ranks x 2 local experts x 4 tensors each
