"""The DeepSpeed config of a run: built from the flags, or read from ``--deepspeed_config``."""

import argparse
import json
from typing import Dict, Optional, Tuple

from megatron.errors import ConfigError
from megatron.training.megatron_compat import was_given

# The flags our DeepSpeed config is built from, where a --deepspeed_config file says the
# same thing, and DeepSpeed's value when the file does not say it. A flag given together
# with a file that says otherwise lost to the file without a word (and the file's
# fp16 with ZeRO stage 0 slipped past --moc-checkpoint's check): now refused.
FILE_KEYS: Tuple[Tuple[str, str, Tuple[str, ...], object], ...] = (
    ("fp16", "--fp16", ("fp16", "enabled"), False),
    ("bf16", "--bf16", ("bf16", "enabled"), False),
    ("zero_stage", "--zero-stage", ("zero_optimization", "stage"), 0),
    ("clip_grad", "--clip-grad", ("gradient_clipping",), 0.0),
    ("loss_scale", "--loss-scale", ("fp16", "loss_scale"), 0.0),
    ("hysteresis", "--hysteresis", ("fp16", "hysteresis"), 2),
)
FP16_ONLY = ("loss_scale", "hysteresis")
SUPPORTED_ZERO_STAGES = (0, 1, 2)


def build_ds_config(args: argparse.Namespace) -> Dict:
    """A DeepSpeed config dict for ``args`` (validated arguments).

    With ``--deepspeed_config FILE`` the file is used, its batch sizes are checked
    against the flags (a mismatch would otherwise fail deep inside DeepSpeed), and
    missing batch keys are filled in from the flags, as are the keys of the given flags
    of :data:`FILE_KEYS` (:func:`reconcile_with_file` refused those that disagree).

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
        config["fp16"] = _fp16_section(args)
    _pipeline_section(args, config, None)
    return config


def _pipeline_section(args: argparse.Namespace, config: Dict, path: Optional[str]) -> None:
    """With tensor and pipeline parallelism, DeepSpeed's pipeline engine splits what a
    stage sends over the tensor-parallel ranks by default (``pipeline.pipe_partitioned``,
    ``grad_partitioned``), which it does not support with MoE layers: they are set off,
    and a ``--deepspeed_config`` file (``path``) that sets them on is refused."""
    if (getattr(args, "pipeline_model_parallel_size", 1) < 2
            or getattr(args, "tensor_model_parallel_size", 1) < 2):
        return
    section = config.setdefault("pipeline", {})
    for key in ("pipe_partitioned", "grad_partitioned"):
        if path is not None and section.get(key):
            raise ConfigError(f"pipeline.{key} = true in --deepspeed_config {path}: DeepSpeed's "
                              "pipeline engine does not split what stages send over the "
                              "tensor-parallel ranks with MoE layers; set it false")
        section[key] = False


def _fp16_section(args: argparse.Namespace) -> Dict:
    return {"enabled": True, "loss_scale": args.loss_scale, "initial_scale_power": 16,
            "loss_scale_window": 1000, "hysteresis": getattr(args, "hysteresis", 2),
            "min_loss_scale": 1}


def read_file(path: str) -> Dict:
    """The ``--deepspeed_config`` file's JSON object.

    Raises:
        ConfigError: it cannot be read or is not JSON.
    """
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--deepspeed_config: cannot read {path}: {e}") from None


def _lookup(config: Dict, keys: Tuple[str, ...]) -> Optional[object]:
    node = config
    if keys[0] == "bf16" and "bf16" not in node:
        keys = ("bfloat16",) + keys[1:]  # DeepSpeed's other name of the section
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _same(flag_value, file_value) -> bool:
    if isinstance(flag_value, bool):
        return flag_value == bool(file_value)
    try:
        return float(flag_value) == float(file_value)
    except (TypeError, ValueError):
        return False


def reconcile_with_file(args: argparse.Namespace) -> None:
    """Every rank, in ``validate_args`` (before any collective): compare the flags of
    :data:`FILE_KEYS` with the ``--deepspeed_config`` file and take the file's values for
    the flags not given, so every later check (fp16 with ZeRO stage 0 under
    ``--moc-checkpoint``, the device's fp16 support) and the banner see what DeepSpeed
    will run. Idempotent (validate_args runs twice).

    Raises:
        ConfigError: a given flag that the file contradicts, naming both; a ZeRO stage
            the trainer does not support.
    """
    path = args.deepspeed_config
    config = read_file(path)
    fp16_on = _lookup(config, ("fp16", "enabled"))
    fp16_on = bool(fp16_on) if fp16_on is not None else bool(args.fp16)
    for dest, flag, keys, default in FILE_KEYS:
        if dest in FP16_ONLY and not fp16_on:
            continue
        value = _lookup(config, keys)
        key = ".".join(keys)
        if was_given(args, dest):
            if value is not None and not _same(getattr(args, dest), value):
                given = getattr(args, dest)
                shown = flag if isinstance(given, bool) else f"{flag} {given}"
                raise ConfigError(f"{shown} conflicts with {key} = "
                                  f"{json.dumps(value)} in --deepspeed_config {path}: "
                                  "remove one of them or make them agree")
            continue
        value = default if value is None else value
        current = getattr(args, dest)
        try:
            setattr(args, dest, bool(value) if isinstance(current, bool) else
                    type(current)(value) if isinstance(current, (int, float)) else value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} = {json.dumps(value)} in --deepspeed_config {path}: "
                              f"not a value {flag} can take") from None
    if args.fp16 and args.bf16:
        raise ConfigError(f"--deepspeed_config {path} enables both fp16 and bf16 (with the "
                          "flags --fp16/--bf16): they are mutually exclusive")
    if args.zero_stage not in SUPPORTED_ZERO_STAGES:
        raise ConfigError(f"zero_optimization.stage = {args.zero_stage} in --deepspeed_config "
                          f"{path}: only ZeRO stages 0, 1 and 2 are supported (as --zero-stage)")


def _fill_given_flags(args: argparse.Namespace, config: Dict) -> None:
    """Write the flags of :data:`FILE_KEYS` that were given and that the file leaves out
    into ``config`` (their value counts, as it does without a file)."""
    for dest, _flag, keys, _default in FILE_KEYS:
        if not was_given(args, dest) or _lookup(config, keys) is not None:
            continue
        if dest == "fp16" and "fp16" not in config:
            config["fp16"] = _fp16_section(args)
            continue
        if dest in FP16_ONLY and not args.fp16:
            continue
        node = config
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = getattr(args, dest)


def _from_file(args: argparse.Namespace) -> Dict:
    path = args.deepspeed_config
    config = read_file(path)
    expected = {"train_batch_size": args.global_batch_size,
                "train_micro_batch_size_per_gpu": args.micro_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps}
    for key, value in expected.items():
        if key in config and config[key] != value:
            raise ConfigError(f"{path}: {key} is {config[key]} but the flags give {value} "
                              "(--global-batch-size / --micro-batch-size / world size)")
        config[key] = value
    _fill_given_flags(args, config)
    _drop_legacy_curriculum(path, config)
    _pipeline_section(args, config, path)
    return config


def _drop_legacy_curriculum(path: str, config: Dict) -> None:
    """Megatron-DeepSpeed's MoE config template carries a disabled top-level
    ``curriculum_learning`` section, which current DeepSpeed rejects outright ("Legacy
    top-level 'curriculum_learning' has been removed"): a disabled one is dropped; an
    enabled one is refused (no curriculum learning here)."""
    section = config.get("curriculum_learning")
    if section is None:
        return
    if isinstance(section, dict) and not section.get("enabled", False):
        del config["curriculum_learning"]
        return
    raise ConfigError(f"--deepspeed_config {path}: curriculum_learning is enabled, and "
                      "curriculum learning is not supported by this trainer")
