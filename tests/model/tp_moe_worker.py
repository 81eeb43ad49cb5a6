"""A rank of the tensor-parallel MoE test: the GPT-MoE model (4 experts, expert
parallelism 2) at tensor-parallel size T (1 or 2; at 2 experts split over the pair, or
replicated over it with ``replicated``), one forward and backward pass on tokens drawn
from the rank's data-parallel rank, with token dropping and without it; with experts
split, once under every MoE schedule. Without token dropping the tokens are drawn so that
the gate's capacity (the largest expert count) is odd. Saves OUT_DIR/rank<R>.pt with each
run's loss, gradients by global name and capacities, and the rank's place.

    tp_moe_worker.py OUT_DIR T TOPK [replicated]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    out_dir, size, topk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    expert_tp = size > 1 and sys.argv[4:] != ["replicated"]
    dist.init_process_group("gloo")
    import deepspeed
    from deepspeed.utils import groups
    from megatron.training import jit_ops
    # as the trainer: no JIT build of DeepSpeed's shm op (a cold build held the ranks
    # 25-35 s, and every checkout of a venv rebuilt it)
    jit_ops.disable_unused_ops()
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm, for its MoE groups
    from megatron.training.parallel_layout import build_layout
    if size > 1:
        from megatron.data.compat import quiet_core_import
        with quiet_core_import():
            from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)
        from megatron.training.mpu import CoreMPU
        groups.mpu = CoreMPU()  # as deepspeed.initialize(mpu=...) sets it
    place = build_layout(dist.get_world_size(), size, 2, expert_tp).place(dist.get_rank())
    from megatron.model.moe_schedules import SCHEDULES, install_schedules
    schedules = SCHEDULES if expert_tp else ("deepspeed",)
    runs = {}
    for drop in (True, False):
        model = _model(size, topk, expert_tp, drop, place)
        tokens, labels = _tokens(model, place, drop)
        for schedule in schedules:
            if expert_tp:
                install_schedules(model, lambda index, layer_groups: schedule)
            runs[(drop, schedule)] = _run(model, tokens, labels, place)
    params = {model.global_name(n): (n, p) for n, p in model.named_parameters()}
    torch.save({"tp_rank": place.tp_rank, "dp_rank": place.dp_rank, "ep_rank": place.ep_rank,
                "runs": runs, "local_names": {g: n for g, (n, _) in params.items()},
                # DeepSpeed's gradient norm counts a parameter without this mark once, on
                # tensor-parallel rank 0 (experts are deep copies of one template).
                "marked": {g: bool(getattr(p, "tensor_model_parallel", False))
                           for g, (_, p) in params.items()},
                "model_parallel": {g: bool(getattr(p, "model_parallel", False))
                                   for g, (_, p) in params.items()}},
               os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    from megatron.training.exit import exit_without_teardown
    exit_without_teardown(0)


def _model(size, topk, expert_tp, drop, place):
    from megatron.model.config import GPTMoEConfig
    from megatron.model.gpt_moe import GPTMoEModel
    config = GPTMoEConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                          max_position_embeddings=16, num_experts=4, moe_expert_parallel_size=2,
                          topk=topk, hidden_dropout=0.0, attention_dropout=0.0,
                          tensor_model_parallel_size=size, enable_expert_tensor_parallelism=expert_tp,
                          moe_token_dropping=drop)
    model = GPTMoEModel(config, ep_rank=place.ep_rank)
    for layer in model.layers:
        if layer.is_moe:
            layer.mlp.set_deepspeed_parallelism()
    return model


def _tokens(model, place, drop):
    """(tokens, labels) of the rank's data-parallel rank: with token dropping the first
    draw; without, the first draw whose largest expert count over both data-parallel
    ranks (the capacity the gate sizes; every layout sees both ranks' tokens) is odd."""
    for attempt in range(50):
        gen = torch.Generator().manual_seed(100 + 1000 * attempt + place.dp_rank)
        tokens = torch.randint(0, 64, (2, 16), generator=gen)
        labels = torch.randint(0, 64, (2, 16), generator=gen)
        if drop:
            return tokens, labels
        with torch.no_grad():
            torch.manual_seed(1234 + place.dp_rank)  # top-2's noise, as in the pass itself
            counts = model(tokens, torch.arange(16).expand_as(tokens), labels)[2]
        largest = counts.max().reshape(1)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        if largest.item() % 2:
            return tokens, labels
    raise RuntimeError("no draw with an odd capacity in 50")


def _run(model, tokens, labels, place):
    """One forward and backward pass: loss, aux loss, routing counts, gradients by global
    name, the largest expert count of both data-parallel ranks, and the capacity the MoE
    layer's gate sized and the one it returned (padded; None at T = 1)."""
    from megatron.model.moe_capacity import capacity_padding
    model.zero_grad(set_to_none=True)
    # Top-2 gating draws Gumbel noise for the second expert from the global generator,
    # which nn.Linear's own init (T = 1) consumed and megatron-core's layers (T = 2) did
    # not: the same state for the pass in both runs.
    torch.manual_seed(1234 + place.dp_rank)
    lm_loss, aux_loss, counts = model(tokens, torch.arange(16).expand_as(tokens), labels)
    (lm_loss + 0.01 * aux_loss).backward()
    largest = counts.max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # over both data-parallel ranks' tokens
    padding = capacity_padding(model.layers[1].mlp.deepspeed_moe.gate)
    return {"loss": lm_loss.detach(), "aux": aux_loss.detach(), "counts": counts,
            "largest_count": largest.item(), "capacity": padding.last if padding else None,
            "grads": {model.global_name(n): p.grad for n, p in model.named_parameters()}}


if __name__ == "__main__":
    main()
