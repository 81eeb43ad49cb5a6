"""The LR schedule in iterations or tokens (--lr-warmup-tokens, --lr-decay-tokens,
--override-opt_param-scheduler) and the early stops (--train-tokens,
--exit-duration-in-mins)."""

import argparse
import multiprocessing
import os
import time
import types

import pytest
import torch

from megatron.training.lr_schedule import build_scheduler, tokens_per_iteration
from megatron.training.stopping import DurationLimit, train_tokens_reached
from tests.launch import free_port

GBS, SEQ = 8, 32
TPI = GBS * SEQ  # tokens per iteration


def _args(**kw):
    base = dict(lr=1e-3, min_lr=1e-5, lr_warmup_iters=0, lr_decay_iters=20, train_iters=20,
                lr_decay_style="cosine", weight_decay=0.1, global_batch_size=GBS, seq_length=SEQ,
                lr_warmup_tokens=None, lr_decay_tokens=None, override_opt_param_scheduler=False)
    base.update(kw)
    return argparse.Namespace(**base)


def _optimizer():
    return types.SimpleNamespace(param_groups=[{}])


def _lrs(scheduler, iterations, tokens_per_step=TPI):
    out = []
    for i in range(1, iterations + 1):
        scheduler.step(1, token_num=i * tokens_per_step)
        out.append(scheduler.optimizer.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "constant"])
def test_whole_iterations_of_tokens_give_the_iteration_schedule(style):
    by_iters = build_scheduler(_optimizer(), _args(lr_decay_style=style, lr_warmup_iters=3,
                                                   lr_decay_iters=16))
    by_tokens = build_scheduler(_optimizer(), _args(lr_decay_style=style,
                                                    lr_warmup_tokens=3 * TPI,
                                                    lr_decay_tokens=16 * TPI))
    expected, got = _lrs(by_iters, 20), _lrs(by_tokens, 20)
    assert got == pytest.approx(expected, rel=1e-12)
    assert expected[0] == pytest.approx(1e-3 / 3)  # warming up, not a flat line


def test_token_warmup_and_decay_follow_the_tokens_not_the_iterations():
    # Half an iteration's tokens per step: the token schedule runs at half speed.
    sched = build_scheduler(_optimizer(), _args(lr_decay_style="linear", lr_warmup_tokens=TPI,
                                                lr_decay_tokens=5 * TPI))
    lrs = _lrs(sched, 12, tokens_per_step=TPI // 2)
    assert lrs[0] == pytest.approx(0.5e-3)          # half-way through the warm-up
    assert lrs[1] == pytest.approx(1e-3)            # warm-up done at TPI tokens
    assert lrs[5] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)  # 3 TPI: half-way decayed
    assert lrs[-1] == pytest.approx(1e-5)           # past --lr-decay-tokens: --min-lr


def test_iteration_warmup_with_token_decay_ends_at_its_tokens():
    """Megatron-DeepSpeed: a warm-up in iterations, a decay in tokens."""
    sched = build_scheduler(_optimizer(), _args(lr_decay_style="linear", lr_warmup_iters=2,
                                                lr_decay_tokens=6 * TPI))
    assert sched.lr_warmup_tokens == 2 * TPI
    lrs = _lrs(sched, 6)
    assert lrs[:2] == pytest.approx([0.5e-3, 1e-3])
    assert lrs[3] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)


def test_state_dict_round_trip_and_unchanged_without_tokens():
    plain = build_scheduler(_optimizer(), _args())
    assert "num_tokens" not in plain.state_dict()  # the iteration schedule's keys only
    sched = build_scheduler(_optimizer(), _args(lr_warmup_tokens=TPI, lr_decay_tokens=10 * TPI))
    _lrs(sched, 4)
    state = sched.state_dict()
    assert state["num_tokens"] == 4 * TPI
    fresh = build_scheduler(_optimizer(), _args(lr_warmup_tokens=TPI, lr_decay_tokens=10 * TPI))
    fresh.load_state_dict(state)
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(
        sched.optimizer.param_groups[0]["lr"])
    assert fresh.num_tokens == 4 * TPI


def test_override_takes_the_flags_over_the_checkpoint():
    saved = build_scheduler(_optimizer(), _args(lr_decay_tokens=10 * TPI)).state_dict()
    kept = build_scheduler(_optimizer(), _args(lr=5e-4, lr_decay_tokens=20 * TPI))
    kept.load_state_dict(saved)
    assert (kept.max_lr, kept.lr_decay_tokens) == (1e-3, 10 * TPI)  # the checkpoint's
    over = build_scheduler(_optimizer(), _args(lr=5e-4, lr_decay_tokens=20 * TPI,
                                               override_opt_param_scheduler=True))
    over.load_state_dict(saved)
    assert (over.max_lr, over.lr_decay_tokens) == (5e-4, 20 * TPI)  # the flags'


def test_train_tokens_reached():
    args = _args(train_tokens=3 * TPI + 1)
    assert tokens_per_iteration(args) == TPI
    assert not train_tokens_reached(args, 3 * GBS)
    assert train_tokens_reached(args, 4 * GBS)
    assert not train_tokens_reached(_args(train_tokens=None), 10 ** 9)


def _duration_rank(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # Rank 1 started 2 minutes ago, rank 0 just now: both must stop together.
        limit = DurationLimit(1.0, started=time.time() - (120 if rank == 1 else 0))
        queue.put((rank, limit.expired(), DurationLimit(1000.0).expired()))
    finally:
        torch.distributed.destroy_process_group()


def test_exit_duration_is_decided_by_every_rank_together():
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_duration_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == [(0, True, False), (1, True, False)]


def test_no_duration_limit_needs_no_collective():
    assert DurationLimit(None).expired() is False  # no process group: would raise
