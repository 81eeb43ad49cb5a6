"""Optional Weights & Biases logging (``--wandb-project``), on rank 0 only.

``validate_args`` refuses ``--wandb-project`` on every rank when the ``wandb`` package is
not installed; :func:`open_wandb` then starts the run on rank 0, as Megatron-DeepSpeed's
``_set_wandb_writer`` does (``dir``, ``name``, ``project``, ``config=vars(args)``).
"""

import argparse
import os
from typing import Optional

from megatron.errors import ConfigError
from megatron.training.tb_tags import Scalar

MISSING = "--wandb-project needs the wandb package (pip install wandb, or the project's [wandb] extra)"


def import_wandb():
    """The ``wandb`` module, or None where it is not installed.

    The seam tests replace (``monkeypatch.setattr(wandb_log, "import_wandb", ...)``) with a
    fake module, so no test reaches the network.
    """
    try:
        import wandb
    except ImportError:
        return None
    return wandb


class WandbWriter:
    """One W&B run: each :class:`Scalar` becomes a ``wandb.log`` call (rank 0 only)."""

    def __init__(self, module, args: argparse.Namespace):
        save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        module.init(dir=save_dir, name=args.wandb_exp_name or None,
                    project=args.wandb_project, config=vars(args))
        self._wandb = module
        self._axes = set()
        self._metrics = set()
        self._iteration = 1

    def add_scalar(self, scalar: Scalar) -> None:
        """``{tag: value}`` at step ``scalar.step``; a ``vs samples``/``vs tokens`` tag is
        logged against its own axis (``define_metric``) at the latest iteration, as upstream."""
        if scalar.axis is None:
            self._wandb.log({scalar.tag: scalar.value}, step=scalar.step)
            self._iteration = max(self._iteration, scalar.step)
            return
        if scalar.axis not in self._axes:
            self._axes.add(scalar.axis)
            self._wandb.define_metric(scalar.axis)
        if scalar.tag not in self._metrics:
            self._metrics.add(scalar.tag)
            self._wandb.define_metric(scalar.tag, step_metric=scalar.axis)
        self._wandb.log({scalar.tag: scalar.value, scalar.axis: scalar.step}, step=self._iteration)

    def close(self) -> None:
        self._wandb.finish()


def open_wandb(args: argparse.Namespace, rank: int) -> Optional[WandbWriter]:
    """The W&B run of ``--wandb-project`` on rank 0; None on other ranks or without the flag.

    Raises:
        ConfigError: the flag is given and ``wandb`` cannot be imported.
    """
    if not getattr(args, "wandb_project", None) or rank != 0:
        return None
    module = import_wandb()
    if module is None:
        raise ConfigError(MISSING)
    return WandbWriter(module, args)
