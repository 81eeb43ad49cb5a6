"""Flags of logging and evaluation (intervals, TensorBoard, Weights & Biases, the metrics
file), and their checks.

The checks run on every rank in :func:`megatron.training.arguments.validate_args`: the
writers are rank 0's alone, after the process group exists, and a rank 0 failing there
would leave the other ranks waiting in the first collective.
"""

import argparse
import importlib.util

from megatron.errors import ConfigError


def add_logging_args(p: argparse.ArgumentParser) -> None:
    """The ``logging and evaluation`` group."""
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=10, help="Log every N iterations.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Evaluate every N iterations.")
    g.add_argument("--eval-iters", type=int, default=10, help="Batches per evaluation; 0: no evaluation.")
    g.add_argument("--tensorboard-dir", help="Write TensorBoard scalars here (needs `tensorboard`).")
    g.add_argument("--metrics-file", help="Append one JSON line per iteration (rank 0) to this file.")
    g.add_argument("--tensorboard-queue-size", type=int, default=None,
                   help="TensorBoard events held before a write (default 100).")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="Also record the time per iteration (iteration-time/iteration-time; "
                        "iteration_time_ms in the metrics file).")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="Also record the global batch size (batch-size/batch-size; "
                        "batch_size in the metrics file).")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Also record the validation perplexity (lm-loss-validation/lm loss "
                        "validation ppl; ppl in the metrics file).")
    g.add_argument("--wandb-project", help="Log the TensorBoard scalars to this Weights & "
                                           "Biases project too (rank 0; needs `wandb`).")
    g.add_argument("--wandb-exp-name", help="The W&B run's name (with --wandb-project).")
    g.add_argument("--wandb-save-dir", help="W&B's local directory (with --wandb-project); "
                                            "default: <save>/wandb.")


def check_logging(args: argparse.Namespace) -> None:
    """--tensorboard-dir needs tensorboard; --wandb-project needs wandb, and its
    companions need it."""
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir needs the tensorboard package "
                          "(pip install tensorboard, or the project's [tensorboard] extra)")
    for flag, value in (("--wandb-exp-name", args.wandb_exp_name),
                        ("--wandb-save-dir", args.wandb_save_dir)):
        if value and not args.wandb_project:
            raise ConfigError(f"{flag} needs --wandb-project")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        from megatron.training.wandb_log import MISSING
        raise ConfigError(MISSING)
