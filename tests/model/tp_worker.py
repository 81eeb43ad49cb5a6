"""A rank of the tensor-parallel model test: builds the dense GPT model at T = 2 (this
rank's slices) and at T = 1 (whole), runs one forward and backward pass of both on the
same tokens, and writes OUT_DIR/rank<R>.json with the differences the test checks.

    tp_worker.py OUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _model(size):
    from megatron.model.config import GPTMoEConfig
    from megatron.model.gpt_moe import GPTMoEModel
    config = GPTMoEConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                          max_position_embeddings=16, num_experts=1, hidden_dropout=0.0,
                          attention_dropout=0.0, tensor_model_parallel_size=size)
    return GPTMoEModel(config)


def _loss_and_grads(model, tokens, labels):
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    lm_loss, _, _ = model(tokens, positions, labels)
    lm_loss.backward()
    return lm_loss.item(), {n: p.grad for n, p in model.named_parameters()}


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    from megatron.data.compat import quiet_core_import
    with quiet_core_import():
        from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    from megatron.model import tensor_parallel as tp
    rank, size = tp.tp_rank_and_size()
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    labels = torch.randint(0, 64, (2, 16), generator=gen)
    whole, parts = _model(1), _model(2)
    loss1, grads1 = _loss_and_grads(whole, tokens, labels)
    loss2, grads2 = _loss_and_grads(parts, tokens, labels)
    weights1 = dict(whole.named_parameters())
    report = {"rank": rank, "size": size, "loss1": loss1, "loss2": loss2,
              "split": [], "replicated": [], "weight_diff": 0.0, "grad_diff": 0.0,
              "grad_scale": 0.0}
    for name, param in parts.named_parameters():
        split = tp.split_of(name, tuple(param.shape), size)
        piece = (lambda t: split.slice(t, rank, size)) if split else (lambda t: t)
        (report["split"] if split else report["replicated"]).append(name)
        # What DeepSpeed reads to count a parameter once in the gradient norm.
        if bool(getattr(param, "tensor_model_parallel", False)) != (split is not None):
            report.setdefault("marked_wrong", []).append(name)
        elif split is not None and param.partition_dim != (split.dim if split.view == split.global_shape else 0):
            report.setdefault("marked_wrong", []).append(name)
        report["weight_diff"] = max(report["weight_diff"],
                                    (param.detach() - piece(weights1[name].detach())).abs().max().item())
        report["grad_diff"] = max(report["grad_diff"],
                                  (grads2[name] - piece(grads1[name])).abs().max().item())
        report["grad_scale"] = max(report["grad_scale"], grads1[name].abs().max().item())
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    from megatron.training.exit import exit_without_teardown
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
