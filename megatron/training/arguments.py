"""Command-line arguments with Megatron-DeepSpeed's flag names, YAML configs, and checks.

Order of precedence: flags on the command line > keys of the ``--config FILE.yaml``
files (a later file over an earlier one) > defaults. YAML keys are the flag names without dashes (``num-layers`` or
``num_layers``); a nested section is flattened with its name as prefix, so
``moc: {pec-k: 1}`` means ``--moc-pec-k 1``. Every problem raises
:class:`~megatron.errors.ConfigError` naming the flag, key or file.

Every rank calls, in this order::

    args = parse_args(argv)                 # flags and --config files; no checks
    validate_args(args, world_size)         # the checks, before any collective

Each group of flags, with its checks, is a module of :mod:`megatron.training.args`; this
module builds the parser from them, runs their checks in order, and re-exports what
callers use (the configurations built from the arguments, the padded vocabulary).
"""

import argparse
import os
from typing import List, Optional, Sequence

from megatron.errors import ConfigError
from megatron.training.args.checks import (MAX_TIMEOUT_S, check_finite, check_output_file,
                                           check_positive, require)
from megatron.training.args.configs import (VOCAB_TENSORS, model_config_from_args,
                                            moc_config_from_args, padded_vocab_from_args,
                                            padded_vocab_size)
from megatron.training.args.data import add_data_args, check_data_paths
from megatron.training.args.logs import add_logging_args, check_logging
from megatron.training.args.moc import (add_moc_args, check_fault_flags, check_moc,
                                        check_moc_numbers, check_moc_with_model, check_shm_dir,
                                        effective_shm_dir, fill_event_file)
from megatron.training.args.model import (MODEL_SHAPE_ARGS, add_model_args, add_moe_args,
                                          check_dropout, check_model, check_moe_layers,
                                          check_moe_schedule, check_tensor_parallel,
                                          fill_position_embeddings)
from megatron.training.args.training import (add_checkpoint_args, add_deepspeed_args,
                                             add_lr_args, add_training_args,
                                             check_distributed_timeout, check_training,
                                             data_parallel_size, fill_batch_sizes,
                                             fill_lr_decay_iters)
from megatron.training.args.restart import add_restart_args, check_restart
from megatron.training.args.yaml_config import yaml_to_argv
from megatron.training.megatron_compat import (add_megatron_compat_args, add_unsupported_args,
                                               add_upstream_switch_args, check_megatron_compat,
                                               given_flags, infer_tokenizer)

__all__ = ["ConfigError", "MAX_TIMEOUT_S", "MODEL_SHAPE_ARGS", "VOCAB_TENSORS", "build_parser",
           "effective_shm_dir", "model_config_from_args", "moc_config_from_args",
           "padded_vocab_from_args", "padded_vocab_size", "parse_args", "validate_args",
           "yaml_to_argv"]

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
            "micro_batch_size", "train_iters", "lr")
"""Flags every run needs (besides its data: --data-path or --train-data-path)."""

POSITIVE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
            "micro_batch_size", "global_batch_size", "train_iters", "num_experts",
            "moe_expert_parallel_size", "expert_interval", "log_interval", "eval_interval",
            "make_vocab_size_divisible_by")
"""Counts that are at least 1 when given."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ConfigError instead of exiting the process.

    Exiting inside argparse on one rank while others continue is how a job hangs;
    raising lets the entry point report the message and exit 2 on every rank.
    """

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            message += self._suggestions(message.split(":", 1)[1].split())
        raise ConfigError(message)

    def _suggestions(self, tokens: Sequence[str]) -> str:
        """For unknown flags: the closest known ones, and where every flag is listed."""
        import difflib
        known = [opt for action in self._actions for opt in action.option_strings]
        hints = []
        for token in tokens:
            if token.startswith("--"):
                close = difflib.get_close_matches(token.split("=", 1)[0], known, n=1)
                hints += [f"{token}: did you mean {close[0]}?"] if close else []
        return ("; " + "; ".join(hints) if hints else "") + \
            " (every flag: pretrain_gpt_moe.py --help, or docs/flags.md)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default after its help, where there is one to show:
    not for switches (off unless given), flags without a value (None, ``[]``) or help
    that already says what the default is."""

    def _get_help_string(self, action):
        default = action.default
        if (isinstance(default, bool) or default is None or default == []
                or "default" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``pretrain_gpt_moe.py``; extension modules may add groups to it."""
    p = _Parser(prog="pretrain_gpt_moe.py", description="GPT-MoE pretraining on DeepSpeed.",
                usage="%(prog)s [--config FILE.yaml] [flag value ...]  (every flag: below, "
                      "or docs/flags.md)",
                allow_abbrev=False, formatter_class=_HelpFormatter)
    p.add_argument("--config", action="append",
                   help="YAML file whose keys are flag names; repeatable (later files win); "
                        "flags win over all of them.")
    from megatron.training.faults import add_fault_args
    from megatron.training.monitor import add_monitor_args
    for add in (add_model_args, add_moe_args, add_training_args, add_lr_args,
                add_checkpoint_args, add_moc_args, add_restart_args, add_monitor_args,
                add_fault_args,
                add_data_args, add_logging_args, add_deepspeed_args, add_megatron_compat_args,
                add_upstream_switch_args, add_unsupported_args):
        add(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None,
               parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """Parse flags and the optional ``--config`` YAML (flags win). Does not validate.

    Raises:
        ConfigError: unknown flag or YAML key, or a value of the wrong type.
    """
    parser = parser or build_parser()
    argv = list(os.sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    yaml_argv: List[str] = []
    for path in known.config:
        file_argv = yaml_to_argv(path, parser)
        try:
            parser.parse_args(file_argv)  # attribute bad values to the file, not the command line
        except ConfigError as e:
            raise ConfigError(f"in {path}: {e}") from None
        yaml_argv += file_argv
    args = parser.parse_args(yaml_argv + argv)
    # What the user set, as opposed to defaults: a --deepspeed_config file may then
    # provide the rest, and --vocab-file alone selects GPT-2 BPE.
    args.given_flags = tuple(sorted(set(given_flags(yaml_argv + argv, parser))))
    return args


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the arguments against each other and the world size; fill derived values.

    Called on every rank before any collective (the trainer calls it again once the
    process group exists, with its world size), so every rank stops with the same message.
    The checks run in the order below; the first problem is the one reported. Adds
    ``data_parallel_size`` and ``gradient_accumulation_steps``, and fills the defaults
    that depend on other flags (``--max-position-embeddings``, ``--global-batch-size``,
    ``--lr-decay-iters``, ``--tokenizer-type``, ``--moc-event-file``).

    Raises:
        ConfigError: naming the flag to fix.
    """
    require(args, REQUIRED)
    check_data_paths(args)
    check_positive(args, POSITIVE)
    check_distributed_timeout(args)
    check_moc_numbers(args)
    check_finite(args)
    fill_position_embeddings(args)
    check_model(args)
    dp = data_parallel_size(args, world_size)
    check_tensor_parallel(args)
    check_moe_layers(args)
    fill_batch_sizes(args, dp)
    fill_lr_decay_iters(args)
    check_training(args)
    check_megatron_compat(args)
    check_moe_schedule(args)
    infer_tokenizer(args)
    check_moc(args, world_size)
    fill_event_file(args)
    check_fault_flags(args, world_size)
    check_restart(args, world_size)
    check_output_file("--metrics-file", args.metrics_file)
    check_output_file("--moc-event-file", args.moc_event_file)
    check_shm_dir(args, world_size)
    check_moc_with_model(args)
    check_logging(args)
    check_dropout(args)
    return args
