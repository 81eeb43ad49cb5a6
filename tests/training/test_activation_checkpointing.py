"""--checkpoint-activations: every transformer layer is recomputed in the backward pass,
and the loss and gradients are those of the plain forward (dropout and MoE layers
included)."""


import pytest
import torch

from megatron.model.config import GPTMoEConfig
from megatron.model.gpt_moe import GPTMoEModel, TransformerLayer
from megatron.training.arguments import model_config_from_args, parse_args
from tests.ds_world import deepspeed_world_of_one

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--data-path", "some/prefix"]


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo group: DeepSpeed's MoE layer needs process groups to run."""
    with deepspeed_world_of_one():
        yield


def _model(checkpoint: bool) -> GPTMoEModel:
    config = GPTMoEConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64,
                          max_position_embeddings=16, num_experts=4, topk=2,
                          hidden_dropout=0.1, attention_dropout=0.1,
                          checkpoint_activations=checkpoint)
    model = GPTMoEModel(config)
    for layer in model.layers:
        if layer.is_moe:
            layer.mlp.set_deepspeed_parallelism()
    return model.train()


@pytest.fixture
def layer_runs(monkeypatch):
    """How many times TransformerLayer.forward ran (module hooks do not see the recompute)."""
    runs = []
    forward = TransformerLayer.forward

    def counting(self, *args):
        runs.append(1)
        return forward(self, *args)

    monkeypatch.setattr(TransformerLayer, "forward", counting)
    return runs


def _loss_and_grads(model, runs):
    torch.manual_seed(7)  # the same dropout masks and gate noise for both models
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(16).expand(2, 16)
    runs.clear()
    lm_loss, aux, counts = model(tokens, positions, tokens.roll(-1, 1))
    (lm_loss + 0.01 * aux).backward()
    return len(runs), lm_loss.detach(), aux.detach(), counts, {n: p.grad.clone()
                                                    for n, p in model.named_parameters()}


def test_recompute_gives_the_same_loss_and_gradients(world_of_one, layer_runs):
    plain_runs, loss, aux, counts, grads = _loss_and_grads(_model(False), layer_runs)
    runs, loss_r, aux_r, counts_r, grads_r = _loss_and_grads(_model(True), layer_runs)
    assert plain_runs == 4
    assert runs == 8  # every layer ran again in the backward pass
    torch.testing.assert_close(loss_r, loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(aux_r, aux, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts_r, counts)
    assert grads_r.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_r[name], grads[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_no_recompute_in_evaluation(world_of_one, layer_runs):
    model = _model(True).eval()
    with torch.no_grad():
        model(torch.zeros(1, 16, dtype=torch.long), torch.arange(16)[None])
    assert len(layer_runs) == 4


@pytest.mark.parametrize("flag", ["--checkpoint-activations",
                                  "--deepspeed-activation-checkpointing"])
def test_both_flags_select_the_recompute(flag):
    args = parse_args(BASE + [flag])
    args.padded_vocab_size, args.max_position_embeddings = 64, 16
    assert model_config_from_args(args).checkpoint_activations is True
    args = parse_args(BASE)
    args.padded_vocab_size, args.max_position_embeddings = 64, 16
    assert model_config_from_args(args).checkpoint_activations is False
