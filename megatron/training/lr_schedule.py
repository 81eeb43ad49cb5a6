"""The learning-rate schedule: megatron.core's scheduler, measured in iterations or tokens.

Megatron-DeepSpeed's scripts give the warm-up and the decay in tokens
(``--lr-warmup-tokens``, ``--lr-decay-tokens``), so that they need no change when the
batch size or the sequence length does. :class:`TokenScheduler` adds that to
megatron.core's ``OptimizerParamScheduler`` with Megatron-DeepSpeed's rules:

* ``--lr-warmup-tokens``: the warm-up is linear in consumed tokens, from 0 to ``--lr``;
* ``--lr-decay-tokens``: the decay runs from the end of the warm-up to that many tokens,
  then the rate stays at ``--min-lr``; a warm-up given in iterations
  (``--lr-warmup-iters``) then ends at the tokens those iterations consume;
* neither: the schedule is megatron.core's, in iterations, unchanged (same rates, same
  ``state_dict``).

One difference from Megatron-DeepSpeed: it steps its scheduler before it adds the
iteration's tokens, so its rate lags one iteration behind its token count. Here the rate
set after iteration ``i`` uses the tokens of iterations ``1..i``, as the iteration-based
schedule uses ``i``: a token schedule given as whole iterations' tokens is exactly the
iteration schedule.
"""

import argparse
import math
from typing import Optional

from megatron.data.compat import quiet_core_import

with quiet_core_import():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def tokens_per_iteration(args: argparse.Namespace) -> int:
    """Tokens one iteration consumes: global batch x sequence length (no curriculum)."""
    return args.global_batch_size * args.seq_length


def uses_tokens(args: argparse.Namespace) -> bool:
    """Whether the run's LR schedule is measured in tokens."""
    return (getattr(args, "lr_warmup_tokens", None) is not None
            or getattr(args, "lr_decay_tokens", None) is not None)


class TokenScheduler(OptimizerParamScheduler):
    """megatron.core's scheduler whose warm-up and decay may be measured in tokens.

    Every rank builds one after ``deepspeed.initialize`` and calls :meth:`step` once per
    iteration with the tokens consumed so far (the same number on every rank).

    Args:
        lr_warmup_tokens: warm-up length in tokens; None: in steps (``lr_warmup_steps``).
        lr_decay_tokens: the token count where the decay ends; None: in steps.
        **kwargs: megatron.core's ``OptimizerParamScheduler`` arguments.
    """

    def __init__(self, optimizer, *, lr_warmup_tokens: Optional[int] = None,
                 lr_decay_tokens: Optional[int] = None, **kwargs):
        self.lr_warmup_tokens = lr_warmup_tokens
        self.lr_decay_tokens = lr_decay_tokens
        self.num_tokens = 0
        super().__init__(optimizer, **kwargs)

    @property
    def by_tokens(self) -> bool:
        """Whether warm-up or decay is measured in tokens."""
        return self.lr_warmup_tokens is not None or self.lr_decay_tokens is not None

    def get_lr(self, param_group: dict) -> float:
        if not self.by_tokens:
            return super().get_lr(param_group)
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.lr_warmup_tokens is None:
            if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
                return self.init_lr + ((max_lr - self.init_lr) * float(self.num_steps)
                                       / float(self.lr_warmup_steps))
            warmup_tokens = 0
        else:
            warmup_tokens = self.lr_warmup_tokens
            if warmup_tokens > 0 and self.num_tokens <= warmup_tokens:
                return max_lr * float(self.num_tokens) / float(warmup_tokens)
        if self.lr_decay_style == "constant":
            return max_lr
        if self.lr_decay_tokens is None:  # token warm-up, decay in steps (as Megatron-DS)
            return super().get_lr(param_group)
        if self.num_tokens > self.lr_decay_tokens:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * max(warmup_tokens, 1) ** 0.5 / max(self.num_tokens, 1) ** 0.5
            return max(min_lr, lr)
        ratio = (float(self.num_tokens - warmup_tokens)
                 / float(self.lr_decay_tokens - warmup_tokens))
        ratio = min(max(ratio, 0.0), 1.0)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"--lr-decay-style {self.lr_decay_style} is not supported with "
                             "--lr-decay-tokens")
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int, token_num: Optional[int] = None) -> None:
        """Advance by ``increment`` iterations; ``token_num``: tokens consumed so far
        (None: unchanged)."""
        if token_num is not None:
            self.num_tokens = int(token_num)
        super().step(increment)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.by_tokens:  # an iteration-based schedule keeps megatron.core's keys only
            state.update(num_tokens=self.num_tokens, lr_warmup_tokens=self.lr_warmup_tokens,
                         lr_decay_tokens=self.lr_decay_tokens)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if "num_tokens" in state_dict:
            self.num_tokens = int(state_dict["num_tokens"])
        for key in ("lr_warmup_tokens", "lr_decay_tokens"):
            if key in state_dict:
                setattr(self, key, self._check_and_set(getattr(self, key), state_dict[key],
                                                       key.replace("_", " ")))
        super().load_state_dict(state_dict)


def build_scheduler(optimizer, args: argparse.Namespace) -> TokenScheduler:
    """The schedule of validated ``args`` for ``optimizer`` (every rank, once, after
    ``deepspeed.initialize``).

    ``--override-opt_param-scheduler``: the flags' values win over a loaded
    checkpoint's (Megatron's meaning); otherwise the checkpoint's win.
    """
    warmup_tokens = getattr(args, "lr_warmup_tokens", None)
    decay_tokens = getattr(args, "lr_decay_tokens", None)
    if decay_tokens is not None and warmup_tokens is None:
        # Megatron-DeepSpeed ends a warm-up given in iterations at the tokens they consumed.
        warmup_tokens = args.lr_warmup_iters * tokens_per_iteration(args)
    override = bool(getattr(args, "override_opt_param_scheduler", False))
    warmup = bool(args.lr_warmup_iters or warmup_tokens)
    return TokenScheduler(
        optimizer, lr_warmup_tokens=warmup_tokens, lr_decay_tokens=decay_tokens,
        init_lr=0.0 if warmup else args.lr, max_lr=args.lr,
        min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
        wd_incr_style="constant", override_opt_param_scheduler=override,
        use_checkpoint_opt_param_scheduler=not override)
