"""Make a DeepSpeed engine's ``save_checkpoint``/``load_checkpoint`` MoC's."""

import functools
from typing import Optional

from deepspeed_ext.checkpointer import MoCCheckpointer
from deepspeed_ext.config import MoCConfig


def enable_moc_checkpointing(engine, config: Optional[MoCConfig] = None) -> MoCCheckpointer:
    """Replace ``engine.save_checkpoint``/``engine.load_checkpoint`` with MoC's; all ranks call it.

    The replacements keep DeepSpeed's signatures and return values:
    ``save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, ...)`` returns
    True; ``load_checkpoint(load_dir, tag=None, ..., load_optimizer_states=True, ...)``
    returns ``(load_path, client_state)``, or ``(None, None)`` when there is nothing to load.
    DeepSpeed's own methods stay reachable as ``engine.deepspeed_save_checkpoint`` and
    ``engine.deepspeed_load_checkpoint``.

    Returns:
        The checkpointer, also set as ``engine.moc``.
    """
    moc = MoCCheckpointer(engine, config)
    engine.deepspeed_save_checkpoint = engine.save_checkpoint
    engine.deepspeed_load_checkpoint = engine.load_checkpoint

    @functools.wraps(engine.deepspeed_save_checkpoint)
    def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        return moc.save(save_dir, tag=tag, client_state=client_state, save_latest=save_latest)

    @functools.wraps(engine.deepspeed_load_checkpoint)
    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        return moc.load(load_dir, tag=tag,
                        load_optimizer_states=load_optimizer_states and not load_module_only,
                        load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only)

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    engine.moc = moc
    return moc
