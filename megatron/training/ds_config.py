"""The DeepSpeed config of a run: built from the flags, or read from ``--deepspeed_config``."""

import argparse
import json
from typing import Dict

from megatron.training.errors import ConfigError


def build_ds_config(args: argparse.Namespace) -> Dict:
    """A DeepSpeed config dict for ``args`` (validated arguments).

    With ``--deepspeed_config FILE`` the file is used, its batch sizes are checked
    against the flags (a mismatch would otherwise fail deep inside DeepSpeed), and
    missing batch keys are filled in from the flags.

    Raises:
        ConfigError: the file is not JSON, or disagrees with the flags.
    """
    if args.deepspeed_config:
        return _from_file(args)
    config = {
        "train_batch_size": args.global_batch_size,
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.clip_grad,
        "zero_optimization": {
            "stage": args.zero_stage,
            "contiguous_gradients": True,
            "overlap_comm": False,
            "reduce_scatter": True,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,  # the training loop logs itself
        "wall_clock_breakdown": False,
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.fp16:
        config["fp16"] = {"enabled": True, "loss_scale": args.loss_scale,
                          "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                          "min_loss_scale": 1}
    return config


def _from_file(args: argparse.Namespace) -> Dict:
    path = args.deepspeed_config
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--deepspeed_config: cannot read {path}: {e}") from None
    expected = {"train_batch_size": args.global_batch_size,
                "train_micro_batch_size_per_gpu": args.micro_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps}
    for key, value in expected.items():
        if key in config and config[key] != value:
            raise ConfigError(f"{path}: {key} is {config[key]} but the flags give {value} "
                              "(--global-batch-size / --micro-batch-size / world size)")
        config[key] = value
    return config
