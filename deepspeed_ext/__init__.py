"""MoC's checkpoint system for DeepSpeed MoE engines.

One call makes an engine's ``save_checkpoint``/``load_checkpoint`` MoC's::

    from deepspeed_ext import MoCConfig, enable_moc_checkpointing
    engine, *_ = deepspeed.initialize(...)
    enable_moc_checkpointing(engine, MoCConfig(pec_k=1))
    engine.save_checkpoint(save_dir, tag, client_state)      # every rank
    path, client_state = engine.load_checkpoint(load_dir)    # every rank, any layout

Modules: ``config`` (MoCConfig), ``state`` (what a rank holds), ``pec`` (which
experts), ``plan`` (who writes what), ``storage``/``objects``/``manifest`` (bytes on
disk), ``reader`` (assembling across checkpoints), ``checkpointer`` (the multi-rank
save/load), ``patch`` (the engine patch), ``cli`` (``moc-ckpt``).
"""

from deepspeed_ext.config import MoCConfig
from deepspeed_ext.runtime import log as _output  # noqa: F401  the package logger's console default


def enable_moc_checkpointing(engine, config=None):
    """See :func:`deepspeed_ext.patch.enable_moc_checkpointing` (imported lazily)."""
    from deepspeed_ext.patch import enable_moc_checkpointing as enable
    return enable(engine, config)


__all__ = ["MoCConfig", "enable_moc_checkpointing"]
