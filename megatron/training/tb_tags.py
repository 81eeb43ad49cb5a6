"""Megatron-DeepSpeed's TensorBoard (and W&B) tag names for the trainer's scalars.

The names, the "vs samples"/"vs tokens" variants and the flags that gate them follow
Megatron-DeepSpeed's ``training_log`` and ``evaluate_and_print_results``, so dashboards
built for it read our runs. The builders here are pure: rank 0's training loop calls
them and hands the result to :meth:`megatron.training.log.MetricsWriter.write`. MoC's own
scalars keep their ``moc/...`` names (no variants).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

SAMPLES_AXIS = "Samples"
"""The x axis of a ``... vs samples`` tag (W&B's custom step name, as upstream)."""
TOKENS_AXIS = "Tokens"
"""The x axis of a ``... vs tokens`` tag."""


@dataclass(frozen=True)
class Scalar:
    """One value to log: TensorBoard's ``add_scalar(tag, value, step)``."""

    tag: str
    value: float
    step: int
    """The iteration, or the consumed samples/tokens for an ``axis`` tag."""
    axis: Optional[str] = None
    """``SAMPLES_AXIS``/``TOKENS_AXIS`` for the "vs" variants; None: the iteration."""
    wandb_only: bool = False
    """Upstream sends it to W&B only (the ``throughput/...`` and ``loss/...`` scalars)."""


@dataclass(frozen=True)
class Position:
    """Where training stands after an iteration (the x values of the three variants)."""

    iteration: int
    samples: int
    tokens: int


def with_variants(tag: str, value: float, at: Position) -> List[Scalar]:
    """``tag`` against iterations, ``tag vs samples`` and ``tag vs tokens``."""
    return [Scalar(tag, value, at.iteration),
            Scalar(f"{tag} vs samples", value, at.samples, SAMPLES_AXIS),
            Scalar(f"{tag} vs tokens", value, at.tokens, TOKENS_AXIS)]


def training_scalars(at: Position, losses: Dict[str, float], lr: float, grad_norm: float,
                     batch_size: int, seq_length: int, loss_scale: Optional[float] = None,
                     fp16: bool = False, log_batch_size: bool = False) -> List[Scalar]:
    """Every iteration's tags, in upstream's order.

    Args:
        losses: the log line's loss names -> this iteration's values (``lm loss``, ``moe
            aux loss``): ``lm-loss-training/<name>``.
        loss_scale: written (``loss-scale/loss-scale``) only with ``fp16`` and a scale.
        log_batch_size: ``--log-batch-size-to-tensorboard``.
    """
    out = [Scalar("steps-vs-samples/y=steps,x=samples", at.iteration, at.samples, SAMPLES_AXIS),
           Scalar("steps-vs-samples/y=samples,x=steps", at.samples, at.iteration),
           Scalar("steps-vs-tokens/y=steps,x=tokens", at.iteration, at.tokens, TOKENS_AXIS),
           Scalar("steps-vs-tokens/y=tokens,x=steps", at.tokens, at.iteration)]
    out += with_variants("learning-rate/learning-rate", lr, at)
    if log_batch_size:
        out += with_variants("batch-size/batch-size", batch_size, at)
    for name, value in losses.items():
        out += with_variants(f"lm-loss-training/{name}", value, at)
    if fp16 and loss_scale:
        out += with_variants("loss-scale/loss-scale", loss_scale, at)
    out += with_variants("grad-norm/grad-norm", grad_norm, at)
    out += with_variants("seqlen/actual_seq_length", seq_length, at)
    return out


def interval_scalars(at: Position, losses: Dict[str, float], seconds_per_iteration: float,
                     rates: Dict[str, float], world_size: int,
                     log_timers: bool = False) -> List[Scalar]:
    """The tags of a log-interval line: W&B's ``throughput/...`` and ``loss/...`` (upstream
    sends them to W&B only) and, with ``--log-timers-to-tensorboard``,
    ``iteration-time/iteration-time`` (seconds per iteration over the interval).

    Args:
        rates: :func:`megatron.training.log.throughput`'s ``samples_per_s``,
            ``tokens_per_s`` and ``tgs``. One replica per rank: the ``_per_replica``
            values divide by ``world_size`` (the data-parallel size here).
    """
    it = at.iteration
    per_replica = {"samples_per_sec_per_replica": rates["samples_per_s"] / world_size,
                   "tokens_per_sec_per_replica": rates["tokens_per_s"] / world_size,
                   "tokens_per_gpu_per_sec_per_replica": rates["tgs"] / world_size}
    values = {"iteration-time": seconds_per_iteration,
              "samples_per_sec": rates["samples_per_s"],
              "samples_per_sec_per_replica": per_replica["samples_per_sec_per_replica"],
              "tokens_per_sec": rates["tokens_per_s"],
              "tokens_per_sec_per_replica": per_replica["tokens_per_sec_per_replica"],
              "tokens_per_gpu_per_sec": rates["tgs"],
              "tokens_per_gpu_per_sec_per_replica":
                  per_replica["tokens_per_gpu_per_sec_per_replica"],
              "elapsed_ms_per_iteration": 1000.0 * seconds_per_iteration}
    out = [Scalar(f"throughput/{key}", value, it, wandb_only=True) for key, value in values.items()]
    out += [Scalar(f"loss/{name}", value, it, wandb_only=True) for name, value in losses.items()]
    if log_timers:
        out += with_variants("iteration-time/iteration-time", seconds_per_iteration, at)
    return out


def validation_scalars(at: Position, loss: float, ppl: float, log_ppl: bool = False,
                       data_type: str = "validation") -> List[Scalar]:
    """``lm-loss-validation/lm loss validation`` and, with
    ``--log-validation-ppl-to-tensorboard``, ``... ppl``, each with its variants."""
    out = with_variants(f"lm-loss-validation/lm loss {data_type}", loss, at)
    if log_ppl:
        out += with_variants(f"lm-loss-validation/lm loss {data_type} ppl", ppl, at)
    return out
