"""``--moe-schedule``: install Parm's MoE schedules on the trainer's engine, measuring the
alpha-beta costs of the layer's groups for ``auto`` (or reading them from
``--moe-schedule-costs``), and log what each MoE layer runs.

Every rank calls :func:`setup_moe_schedules` after ``deepspeed.initialize`` (the
calibration and the combined groups are collectives).
"""

import json
import statistics
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.model.moe_collectives import MoEGroups
from megatron.model.moe_cost import GroupLinks, LayerShape, Link, capacity_of, choose

CALIBRATION_BYTES = (64 << 10, 4 << 20)
"""Per-rank message sizes of the calibration: one dominated by latency, one by bandwidth."""
CALIBRATION_REPEATS = 5
"""Timed repeats per group and size (the median is taken, then the maximum over ranks)."""


def _timed(op, repeats: int, cuda: bool) -> float:
    """Median seconds of ``op()`` after one warm-up; every rank starts each at a barrier
    (on CUDA, once the device has finished the op)."""
    from deepspeed_ext.runtime.groups import metadata_group
    op()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=metadata_group())
        start = time.perf_counter()
        op()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_link(ranks: int, points) -> Link:
    """``Link`` through two ``(bytes, seconds)`` points of ``alpha (n-1) + beta B (n-1)/n``
    (negative fits clamped to 0: noise on a quiet link)."""
    (b1, t1), (b2, t2) = points
    share = (ranks - 1) / ranks
    beta = max((t2 - t1) / ((b2 - b1) * share), 0.0)
    alpha = max((t1 - beta * b1 * share) / (ranks - 1), 0.0)
    return Link(alpha, beta)


def measure_links(g: MoEGroups, repeats: int = CALIBRATION_REPEATS) -> GroupLinks:
    """Every rank: time all-to-alls over the expert-parallel and the combined group and
    all-gathers over the tensor-parallel group at :data:`CALIBRATION_BYTES`, and fit each
    group's alpha and beta (the slowest rank's times: a collective ends with its last).
    The messages are device tensors on NCCL (the groups' backend), CPU ones on gloo."""
    from deepspeed_ext.runtime.groups import metadata_group
    cuda = dist.get_backend(g.ep_group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    links = {}
    for name, group, ranks in (("ep", g.ep_group, g.ep_size), ("tp", g.tp_group, g.tp_size),
                               ("combined", g.combined_group, g.ep_size * g.tp_size)):
        if ranks == 1:
            links[name] = Link(0.0, 0.0)
            continue
        points = []
        for nbytes in CALIBRATION_BYTES:
            elems = nbytes // 4
            if name == "tp":
                send = torch.ones(elems // ranks, device=device)
                recv = torch.empty(elems // ranks * ranks, device=device)
                op = lambda: dist.all_gather_into_tensor(recv, send, group=group)  # noqa: E731
            else:
                send = torch.ones(elems // ranks * ranks, device=device)
                recv = torch.empty_like(send)
                op = lambda: dist.all_to_all_single(recv, send, group=group)  # noqa: E731
            seconds = torch.tensor([_timed(op, repeats, cuda)], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=metadata_group())
            points.append((float(nbytes), seconds.item()))
        links[name] = fit_link(ranks, points)
    return GroupLinks(**links)


def _read_costs(path: str) -> GroupLinks:
    try:
        with open(path) as f:
            return GroupLinks.from_record(json.load(f))
    except (OSError, ValueError) as err:
        raise ConfigError(f"--moe-schedule-costs {path}: {err}") from None


def layer_shape(args) -> LayerShape:
    """The shape every MoE layer of the trainer's model moves per micro-batch."""
    tokens = args.micro_batch_size * args.seq_length
    tp = getattr(args, "tensor_model_parallel_size", 1)
    capacity = capacity_of(tokens, args.num_experts, args.topk, args.moe_train_capacity_factor,
                           args.moe_min_capacity, not args.disable_moe_token_dropping, tp)
    return LayerShape(experts=args.num_experts, capacity=capacity, hidden=args.hidden_size,
                      ep=args.moe_expert_parallel_size, tp=tp,
                      bytes_per_element=2 if (args.fp16 or args.bf16) else 4)


def setup_moe_schedules(model, args, log) -> Optional[List]:
    """Install ``args.moe_schedule`` on every MoE layer of ``model`` (every rank); log one
    line per layer with ``log`` (rank 0's printer). Returns the install report, None for
    ``deepspeed``."""
    from megatron.model.moe_schedules import install_schedules
    schedule = args.moe_schedule
    if schedule == "deepspeed":
        return None
    choice = {}
    if schedule == "auto":
        links = None
        if args.moe_schedule_costs:
            links = _read_costs(args.moe_schedule_costs)
        shape = layer_shape(args)

        def pick(index, groups):
            nonlocal links
            if links is None:  # one calibration: every layer has the same groups
                links = measure_links(groups)
                log(f"> MoE schedule calibration (alpha s, beta s/byte): "
                    f"{json.dumps(links.to_record())}")
            best, times = choose(shape, links)
            choice[index] = (best, times)
            return best
    else:
        def pick(index, groups):
            return schedule
    report = install_schedules(model, pick)
    for index, (path, runs) in enumerate(report):
        predicted = ""
        if index in choice:
            predicted = " (predicted communication per pass: " + ", ".join(
                f"{s} {t * 1e3:.3f} ms" for s, t in choice[index][1].items()) + ")"
        log(f"> MoE schedule of {path}: {runs}{predicted}")
    return report
