"""The GPT-MoE model on one process: layout-independent init, causality, gate counts."""


import pytest
import torch

from megatron.model.config import GPTMoEConfig
from megatron.model.gpt_moe import GPTMoEModel, count_parameters
from tests.ds_world import deepspeed_world_of_one


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo group: DeepSpeed's MoE layer needs process groups to run."""
    with deepspeed_world_of_one():
        yield


def _config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                max_position_embeddings=16, num_experts=4, topk=2, hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return GPTMoEConfig(**base)


def _ready(model):
    for layer in model.layers:
        if layer.is_moe:
            layer.mlp.set_deepspeed_parallelism()
    return model


def test_expert_init_depends_on_global_index_only():
    full = GPTMoEModel(_config(moe_expert_parallel_size=1))
    half = GPTMoEModel(_config(moe_expert_parallel_size=2), ep_rank=1)  # holds experts 2 and 3
    full_params = dict(full.named_parameters())
    for name, param in half.named_parameters():
        assert torch.equal(param, full_params[half.global_name(name)]), name
    assert half.global_name("layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.0.dense_h_to_4h.weight") \
        == "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.2.dense_h_to_4h.weight"
    # Distinct experts really are distinct.
    e = "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.{}.dense_h_to_4h.weight"
    assert not torch.equal(full_params[e.format(0)], full_params[e.format(1)])


def test_moe_layers_and_parameter_count():
    cfg = _config(num_layers=6, expert_interval=2)
    assert cfg.moe_layer_indices == [1, 3, 5]
    model = GPTMoEModel(cfg)
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert _config(num_experts=1).moe_layer_indices == []


def test_forward_is_causal_and_counts_assignments(world_of_one):
    torch.manual_seed(0)
    # Capacity big enough that no token is dropped: GShard's capacity competition is
    # across the whole batch, so a dropped token would make routing non-causal.
    model = _ready(GPTMoEModel(_config(position_embedding_type="rope",
                                       moe_eval_capacity_factor=8.0))).eval()
    tokens = torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        torch.manual_seed(1)  # DeepSpeed's top-2 gate samples the second expert
        logits = model(tokens, pos)
        changed = tokens.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 64
        torch.manual_seed(1)
        logits2 = model(changed, pos)
        lm, aux, counts = model(tokens, pos, labels=tokens, loss_mask=torch.ones(2, 16))
    assert logits.shape == (2, 16, 64)
    assert torch.allclose(logits[:, :-1], logits2[:, :-1], atol=1e-6)
    assert not torch.allclose(logits[:, -1], logits2[:, -1])
    assert counts.shape == (1, 4) and counts.dtype == torch.int64
    assert counts.sum().item() == 2 * 16 * 2  # every token routed to top-2 experts
    assert lm.item() > 0 and aux.item() > 0


def test_loss_goes_down_when_trained(world_of_one):
    torch.manual_seed(0)
    model = _ready(GPTMoEModel(_config()))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 16))
    pos = torch.arange(16).expand(4, 16)
    losses = []
    for _ in range(30):
        lm, aux, _ = model(tokens[:, :-1], pos[:, :-1], labels=tokens[:, 1:])
        (lm + 0.01 * aux).backward()
        opt.step()
        opt.zero_grad()
        losses.append(lm.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("kw, needle", [
    (dict(hidden_size=30), "divisible by --num-attention-heads"),
    (dict(num_experts=6, moe_expert_parallel_size=4), "divisible by --moe-expert-parallel-size"),
    (dict(position_embedding_type="alibi"), "position-embedding-type"),
])
def test_config_checks(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _config(**kw)


def test_mixtral_8x7b_has_mixtral_s_parameter_count():
    """configs/mixtral-8x7b.yaml's shape with Mixtral's 32,000-token vocabulary: 46,702,792,704
    parameters, the count of Hugging Face's Mixtral-8x7B (every tensor of it, the untied
    output layer included)."""
    cfg = GPTMoEConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                       max_position_embeddings=32768, position_embedding_type="rope",
                       num_experts=8, expert_interval=1, topk=2, swiglu=True,
                       normalization="rmsnorm", add_bias_linear=False,
                       untie_embeddings_and_output_weights=True)
    counts = count_parameters(cfg)
    assert counts["total"] == 46_702_792_704
    assert counts["expert"] == 32 * 8 * 3 * 4096 * 14336
