"""MoC's checkpoint system for DeepSpeed engines.

This package will replace a DeepSpeed engine's ``save_checkpoint``/``load_checkpoint``
with MoC's (partial experts checkpointing, fully sharded saves, two-level snapshots).
Until then the training uses DeepSpeed's own checkpoints (see
``megatron/training/checkpointing.py``), the baseline MoC is measured against.
"""

__all__: list = []
