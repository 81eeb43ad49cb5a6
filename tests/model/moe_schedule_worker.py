"""A rank of the MoE-schedule test: one GPT-MoE MoE layer (2 local experts) at
tensor-parallel size 2 with expert sharding and expert-parallel size EP, run forward and
backward under every schedule on the same input, for top-1 and top-2, with and without
capacity drops; saves OUT_DIR/rank<R>.pt with each run's output, aux loss, input
gradient and parameter gradients.

    moe_schedule_worker.py OUT_DIR EP
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _inputs(moe, place, drop):
    """(tokens, loss weights), the same on the tensor-parallel pair. Without token dropping
    the capacity is the largest expert count over the expert-parallel group (the gate
    all-reduces it), which the layer splits over the pair: draw until it is odd, the case
    the model pads to a multiple of T (megatron.model.moe_capacity)."""
    from megatron.model.moe_capacity import capacity_padding
    padding = capacity_padding(moe.deepspeed_moe.gate)
    for attempt in range(50):
        gen = torch.Generator().manual_seed(10 + 100 * attempt + place.dp_rank)
        x = torch.randn(2, 16, 32, generator=gen)
        probe = torch.randn(2, 16, 32, generator=gen)
        if drop:
            return x, probe
        torch.manual_seed(1234 + place.dp_rank)
        moe.deepspeed_moe.gate(x.reshape(-1, 32), None, True, False)
        odd = torch.tensor([padding.last[0] % 2])  # the gate's own capacity, not the padded one
        dist.all_reduce(odd, op=dist.ReduceOp.MIN)  # every rank takes the same draw
        if odd.item():
            return x, probe
    raise RuntimeError("no input with an odd capacity in 50 draws")


def main():
    out_dir, ep = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    import deepspeed
    from deepspeed.utils import groups
    from megatron.training import jit_ops
    # as the trainer: no JIT build of DeepSpeed's shm op (a cold build held the ranks
    # 25-35 s, and every checkout of a venv rebuilt it)
    jit_ops.disable_unused_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron.data.compat import quiet_core_import
    with quiet_core_import():
        from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    from megatron.training.mpu import CoreMPU
    groups.mpu = CoreMPU()
    from megatron.model.config import GPTMoEConfig
    from megatron.model.gpt_moe import GPTMoEModel
    from megatron.model.moe_capacity import capacity_padding
    from megatron.model.moe_schedules import SCHEDULES, install_schedules
    from megatron.training.parallel_layout import build_layout
    place = build_layout(dist.get_world_size(), 2, ep).place(dist.get_rank())
    results = {}
    for topk in (1, 2):
        for drop in (True, False):
            config = GPTMoEConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                  max_position_embeddings=16, num_experts=2 * ep,
                                  moe_expert_parallel_size=ep, topk=topk, hidden_dropout=0.0,
                                  attention_dropout=0.0, tensor_model_parallel_size=2,
                                  enable_expert_tensor_parallelism=True, moe_token_dropping=drop,
                                  moe_train_capacity_factor=0.5 if drop else 1.0)
            model = GPTMoEModel(config, ep_rank=place.ep_rank)
            moe = model.layers[1].mlp
            moe.set_deepspeed_parallelism()
            x, probe = _inputs(moe, place, drop)
            for schedule in SCHEDULES:
                report = install_schedules(model, lambda i, m: schedule)
                assert report == [("layers.1.mlp", schedule)], report
                model.zero_grad(set_to_none=True)
                inp = x.clone().requires_grad_(True)
                torch.manual_seed(1234 + place.dp_rank)  # top-2's second-expert noise
                out, l_aux, counts = moe(inp)
                ((out * probe).sum() + 0.1 * l_aux).backward()
                torch.manual_seed(1234 + place.dp_rank)
                routes = moe.deepspeed_moe.gate(x.reshape(-1, 32), None, True, False)[3]
                results[(topk, drop, schedule)] = {
                    "out": out.detach(), "l_aux": l_aux.detach(), "counts": counts,
                    "capacity": capacity_padding(moe.deepspeed_moe.gate).last,
                    "dropped": int((routes < 0).sum()),
                    "x_grad": inp.grad,
                    "grads": {n: p.grad for n, p in moe.named_parameters()}}
    torch.save({"results": results, "tp_rank": place.tp_rank, "dp_rank": place.dp_rank},
               os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    from megatron.training.exit import exit_without_teardown
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
