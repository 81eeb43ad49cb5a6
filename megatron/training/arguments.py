"""Command-line arguments with Megatron-DeepSpeed's flag names, YAML configs, and checks.

Order of precedence: flags on the command line > keys of the ``--config FILE.yaml``
files (a later file over an earlier one) > defaults. YAML keys are the flag names without dashes (``num-layers`` or
``num_layers``); a nested section is flattened with its name as prefix, so
``moc: {pec-k: 1}`` means ``--moc-pec-k 1``. Every problem raises
:class:`~megatron.errors.ConfigError` naming the flag, key or file.
"""

import argparse
import importlib.util
import math
import os
import threading
from typing import Dict, List, Optional, Sequence

from deepspeed_ext.keeper import SUN_PATH_MAX as UNIX_SOCKET_PATH_MAX
from megatron.errors import ConfigError
from megatron.training.parallel_layout import build_layout
from megatron.training.megatron_compat import (NumExpertsAction, add_megatron_compat_args,
                                               add_unsupported_args, add_upstream_switch_args,
                                               check_megatron_compat, given_flags,
                                               infer_tokenizer)

# UNIX_SOCKET_PATH_MAX (107 bytes: ``sockaddr_un.sun_path`` holds 108 with its NUL): a
# node's keeper listens on :func:`keeper_socket_path`, so ``--moc-shm-dir`` must leave
# room for it.

# Settings that fix the shape of the model: a checkpoint saved with other values
# cannot be loaded, and the error names the first one that differs.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_experts", "expert_interval", "padded_vocab_size",
                    "max_position_embeddings", "position_embedding_type")

MAX_TIMEOUT_S = threading.TIMEOUT_MAX
"""The longest wait (seconds) Python's timed waits accept; longer ones raise OverflowError
(in the middle of a save or the shutdown) instead of waiting."""


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


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, help="Transformer layers (required).")
    g.add_argument("--hidden-size", type=int, help="Model width (required).")
    g.add_argument("--ffn-hidden-size", type=int, default=0, help="MLP inner width; 0: 4 * hidden size.")
    g.add_argument("--num-attention-heads", type=int, help="Attention heads (required).")
    g.add_argument("--seq-length", type=int, help="Tokens per sample (required).")
    g.add_argument("--max-position-embeddings", type=int,
                   help="Position table size; default: --seq-length.")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope"],
                   help="A learned position table, or rope: a rotary embedding over whole heads "
                        "(base 10000, adjacent pairs of dimensions rotated).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this.")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5, help="LayerNorm epsilon.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after attention and MLP.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")


def _add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, nargs="+", default=1, action=NumExpertsAction,
                   help="Experts per MoE layer; 1: dense model. One count only: PR-MoE's "
                        "per-layer list is refused.")
    g.add_argument("--moe-expert-parallel-size", type=int, default=1,
                   help="Ranks the experts of a layer are spread over; must divide --num-experts "
                        "and the world size.")
    g.add_argument("--expert-interval", type=int, default=2, help="Every N-th layer is an MoE layer.")
    g.add_argument("--topk", type=int, default=1, choices=[1, 2], help="Experts per token.")
    g.add_argument("--moe-loss-coeff", type=float, default=0.01,
                   help="Weight of the load-balancing loss added to the LM loss.")
    g.add_argument("--moe-train-capacity-factor", type=float, default=1.0, help="Capacity factor in training.")
    g.add_argument("--moe-eval-capacity-factor", type=float, default=1.0, help="Capacity factor in evaluation.")
    g.add_argument("--moe-min-capacity", type=int, default=4, help="Minimum expert capacity in tokens.")
    g.add_argument("--disable-moe-token-dropping", action="store_true",
                   help="Never drop tokens over an expert's capacity.")
    g.add_argument("--moe-schedule", default="deepspeed",
                   choices=["deepspeed", "parm-s1", "parm-s2", "auto"],
                   help="How MoE layers with experts split over the tensor-parallel ranks "
                        "dispatch and combine tokens: DeepSpeed's own, Parm's S1 or S2, or auto "
                        "(per layer, by an alpha-beta cost model of the layer's groups, measured "
                        "at start; docs/moe-schedules.md).")
    g.add_argument("--moe-schedule-costs", default=None, metavar="FILE",
                   help="With --moe-schedule auto: the groups' alpha/beta from this JSON file "
                        "({ep, tp, combined: {alpha, beta}}) instead of measuring them.")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, help="Samples per rank per forward (required).")
    g.add_argument("--global-batch-size", type=int,
                   help="Samples per optimizer step; default: micro batch x data-parallel size.")
    g.add_argument("--train-iters", type=int, help="Optimizer steps to train for (required).")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="Also stop once this many tokens (global batch x sequence length per "
                        "iteration) are consumed, if that comes before --train-iters.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="After this many minutes since the start, save (with --save) and exit "
                        "cleanly; every rank agrees through one all-reduce per iteration.")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Recompute each transformer layer's activations in the backward pass "
                        "instead of keeping them (torch.utils.checkpoint): less memory, about "
                        "one more forward pass of compute.")
    g.add_argument("--seed", type=int, default=1234, help="Seed of init, dropout and data order.")
    g.add_argument("--deterministic", action="store_true",
                   help="Deterministic kernels (torch.use_deterministic_algorithms, cuBLAS "
                        "workspace, math attention): bitwise-repeatable runs on CUDA too. "
                        "Implied by --moc-mode exact on CUDA.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global gradient-norm clip; 0: off.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon.")
    g.add_argument("--bf16", action="store_true", help="bfloat16 compute with fp32 master weights.")
    g.add_argument("--fp16", action="store_true", help="float16 compute with dynamic loss scaling.")
    g.add_argument("--loss-scale", type=float, default=0.0, help="fp16 static loss scale; 0: dynamic.")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="fp16 dynamic loss scaling: overflows tolerated before the scale drops "
                        "(DeepSpeed's fp16.hysteresis).")
    g.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2], help="DeepSpeed ZeRO stage.")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="A collective that waits longer fails instead of hanging.")
    g.add_argument("--num-threads", type=int, default=0,
                   help="CPU threads per rank; 0: cores / local ranks (unless OMP_NUM_THREADS is set).")

    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, help="Peak learning rate (required).")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate at the end of decay.")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"], help="Decay shape.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup steps.")
    g.add_argument("--lr-decay-iters", type=int, help="Decay steps; default: --train-iters.")
    g.add_argument("--lr-warmup-tokens", type=int, default=None,
                   help="Linear warmup over this many consumed tokens (instead of "
                        "--lr-warmup-iters).")
    g.add_argument("--lr-decay-tokens", type=int, default=None,
                   help="Decay until this many consumed tokens (instead of --lr-decay-iters).")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="On --load, take the schedule's settings (rates, warmup, decay) from "
                        "the flags instead of the checkpoint.")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="Directory to save checkpoints to.")
    g.add_argument("--load", help="Directory to resume from; empty or missing: start from scratch.")
    g.add_argument("--save-interval", type=int, default=0, help="Save every N iterations; 0: only at the end.")
    g.add_argument("--exit-interval", type=int, default=0,
                   help="Save (with --save) and exit once the iteration is a multiple of N; "
                        "the schedule still follows --train-iters.")
    g.add_argument("--no-load-optim", action="store_true", help="Load weights only, not optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not restore RNG states.")


def _add_moc_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MoC checkpointing")
    g.add_argument("--moc-checkpoint", action="store_true",
                   help="Save and load through MoC (deepspeed_ext) instead of DeepSpeed's own path.")
    g.add_argument("--moc-pec-k", type=int, default=0,
                   help="Experts saved per MoE layer per checkpoint; 0: all.")
    g.add_argument("--moc-pec-policy", default="sequential", choices=["sequential", "load-aware"],
                   help="Which experts a partial checkpoint saves: sequential rotates through "
                        "each MoE layer's experts (staggered across layers and expert-parallel "
                        "ranks); load-aware takes, per layer, those with the most tokens routed "
                        "to them since their last save.")
    g.add_argument("--moc-pec-scope", default="wo", choices=["wo", "w", "o"],
                   help="What a partial checkpoint leaves out of the experts it does not "
                        "select (the MoC paper's variants): wo both weights and optimizer "
                        "state, w the weights only (every expert's optimizer state is saved), "
                        "o the optimizer state only (every expert's weights are saved).")
    g.add_argument("--moc-keep", type=int, default=0,
                   help="Complete checkpoints to keep (still-referenced expert versions are "
                        "never deleted); 0: all.")
    g.add_argument("--moc-two-level", action="store_true",
                   help="Two-level checkpointing: each save is an asynchronous snapshot into a "
                        "per-node keeper's shared memory; every --moc-persist-interval-th "
                        "snapshot is persisted to --save in the background; --load recovers "
                        "from memory first.")
    g.add_argument("--moc-mode", default="pec", choices=["pec", "exact"],
                   help="pec: checkpoints as the other --moc-* flags say; exact: also a "
                        "sparse frame every iteration (one group of operators with fp32 "
                        "weights and optimizer state, the later groups' compute weights), "
                        "and recovery replays the newest complete window to the exact state "
                        "(no lost tokens). Needs --moc-checkpoint and --save.")
    g.add_argument("--moc-window", type=int, default=0,
                   help="Exact mode: iterations per window of frames; 0: the smallest window "
                        "whose frame copy hides behind an iteration, measured at the start.")
    g.add_argument("--moc-upstream-logging", action="store_true",
                   help="Exact mode with --pipeline-model-parallel-size > 1: each stage keeps "
                        "in host memory what it sends to its neighbours (activations forward, "
                        "input gradients back) for two windows, MoEtion's upstream logs.")
    g.add_argument("--moc-upstream-log-gb", type=float, default=1.0,
                   help="Host memory a stage's upstream log may take (GB, per rank), checked "
                        "before training; 0: unchecked.")
    g.add_argument("--moc-expected-mtbf", type=float, default=0.0,
                   help="Exact mode: expected seconds between failures; the automatic window "
                        "then weighs a frame's cost against the replay each failure costs "
                        "(default: --moc-fault-mtbf when given, else unknown).")
    g.add_argument("--moc-k-snapshot", type=int, default=0,
                   help="Experts per MoE layer in each in-memory snapshot; 0: all.")
    g.add_argument("--moc-k-persist", type=int, default=None,
                   help="Experts per MoE layer persisted to storage (default: --moc-pec-k, "
                        "which it replaces; at most --moc-k-snapshot).")
    g.add_argument("--moc-snapshot-interval", type=int, default=0,
                   help="Iterations between snapshots with --moc-two-level; 0: --save-interval.")
    g.add_argument("--moc-persist-interval", type=int, default=1,
                   help="Persist every N-th snapshot to storage.")
    g.add_argument("--moc-ranks-per-node", type=int, default=0,
                   help="Ranks per node for the keepers; 0: the launcher's (LOCAL_WORLD_SIZE, LOCAL_SIZE "
                        "or SLURM_NTASKS_PER_NODE). "
                        "Smaller values simulate several nodes on one machine.")
    g.add_argument("--moc-redundancy", default="none", choices=("none", "replicate", "erasure"),
                   help="With --moc-two-level: keep the snapshots also in other nodes' memory, "
                        "so a lost node recovers from its peers instead of storage: copies "
                        "(replicate) or XOR parity across groups of nodes (erasure).")
    g.add_argument("--moc-replicas", type=int, default=1,
                   help="--moc-redundancy replicate: peer nodes holding a copy of each "
                        "node's snapshots (that many lost nodes are covered).")
    g.add_argument("--moc-ec-data", type=int, default=2,
                   help="--moc-redundancy erasure: data nodes per group; each group of "
                        "--moc-ec-data + 1 nodes survives one lost node, holding "
                        "1/--moc-ec-data of a snapshot extra per rank.")
    g.add_argument("--moc-ec-parity", type=int, default=1,
                   help="--moc-redundancy erasure: parity pieces per group; only 1 (XOR).")
    g.add_argument("--moc-redundancy-interval", type=int, default=1,
                   help="Protect every N-th snapshot in the peers' memory (the traffic and "
                        "its CPU cost divided by N; a lost node resumes at most N-1 "
                        "snapshots further back).")
    g.add_argument("--moc-shm-dir", default=None,
                   help="Shared-memory directory of the job: one node<N>/ per node with its "
                        "keeper's socket and, by mode, the ranks' snapshot slots and the peers' "
                        "copies (--moc-two-level) or the frames of the recent windows (--moc-mode "
                        "exact); default: derived from --save under /dev/shm (stable across "
                        "restarts of one job).")
    g.add_argument("--moc-host-memory-gb", type=float, default=0.0,
                   help="Host memory one rank's snapshot slots (--moc-two-level) or a window of "
                        "frames (--moc-mode exact) may use; 0: unchecked.")
    g.add_argument("--moc-checksum-threads", type=int, default=0,
                   help="--moc-two-level: threads hashing each snapshot's image after its copy, "
                        "off the optimizer step's path; 0: up to 4, half the host's cores.")
    g.add_argument("--moc-dynamic-k", action="store_true",
                   help="After each recovery, double the experts per checkpoint (up to all) "
                        "while the accumulated proportion of lost tokens exceeds "
                        "--moc-plt-threshold (the MoC paper's dynamic K).")
    g.add_argument("--moc-plt-threshold", type=float, default=0.0375,
                   help="Accumulated PLT above which --moc-dynamic-k doubles K; in (0, 1).")
    g.add_argument("--moc-event-file", default=None,
                   help="JSON-lines file of failures, detections and recoveries (PLT, K, "
                        "iterations lost); default: <save>/moc-events.jsonl for a local --save.")
    g.add_argument("--moc-commit-timeout", type=float, default=600.0,
                   help="Seconds a checkpoint may take to be written and committed before "
                        "the save counts as failed (every rank's file durable, the "
                        "manifest written).")
    g.add_argument("--moc-restart-count", type=int, default=None,
                   help="Which attempt of the job this is (0: the first), for the event file "
                        "and ETTR; default: TORCHELASTIC_RESTART_COUNT or MOC_RESTART_COUNT "
                        "from the environment (scripts/launch_cluster.sh passes this flag).")
    g.add_argument("--moc-sync-save", action="store_true",
                   help="Wait until each checkpoint is written and committed; by default a "
                        "save returns once the state is in host memory and is written in "
                        "the background.")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+",
                   help="Indexed dataset prefix, or 'w1 prefix1 w2 prefix2 ...' for a blend "
                        "(required, unless --train-data-path is given).")
    g.add_argument("--split", default="969,30,1",
                   help="Train,valid,test proportions of the --data-path documents.")
    for name, use in (("train", "training set, instead of --data-path and --split"),
                      ("valid", "validation set, with --train-data-path (else none)"),
                      ("test", "test set, with --train-data-path (else none)")):
        g.add_argument(f"--{name}-data-path", nargs="+",
                       help=f"The {use}: a prefix or a weighted blend as for --data-path, each "
                            "dataset used whole (Megatron-DeepSpeed's separate datasets).")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer",
                   help="ByteLevelTokenizer, or GPT2BPETokenizer with --vocab-file and --merge-file.")
    g.add_argument("--vocab-file", help="Tokenizer vocabulary file (GPT-2 vocab.json); without "
                                        "--tokenizer-type it selects GPT2BPETokenizer.")
    g.add_argument("--merge-file", help="BPE merges file (GPT-2 merges.txt); without "
                                        "--tokenizer-type it selects GPT2BPETokenizer.")
    g.add_argument("--data-cache-path", help="Where dataset index caches are written.")
    g.add_argument("--num-workers", type=int, default=0, help="Data loader worker processes.")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
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


def _check_wandb(args: argparse.Namespace) -> None:
    """Every rank: --wandb-project needs wandb (failing later on rank 0 alone would leave the
    other ranks waiting in the first collective); its companions need it."""
    for flag, value in (("--wandb-exp-name", args.wandb_exp_name),
                        ("--wandb-save-dir", args.wandb_save_dir)):
        if value and not args.wandb_project:
            raise ConfigError(f"{flag} needs --wandb-project")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        from megatron.training.wandb_log import MISSING
        raise ConfigError(MISSING)


def _add_deepspeed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deepspeed")
    g.add_argument("--deepspeed", action="store_true", help="Accepted for compatibility; always on.")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="DeepSpeed JSON config; default: built from the flags.")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="Set by the launcher.")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="Same as --checkpoint-activations (the recompute is torch's).")


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
    for add in (_add_model_args, _add_moe_args, _add_training_args, _add_checkpoint_args,
                _add_moc_args, add_monitor_args, add_fault_args, _add_data_args,
                _add_logging_args, _add_deepspeed_args, add_megatron_compat_args,
                add_upstream_switch_args, add_unsupported_args):
        add(p)
    return p


def _flatten(mapping: Dict, prefix: str = "") -> Dict[str, object]:
    out = {}
    for key, value in mapping.items():
        name = f"{prefix}{str(key).replace('_', '-')}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "-"))
        else:
            out[name] = value
    return out


def yaml_to_argv(path: str, parser: argparse.ArgumentParser) -> List[str]:
    """Turn a YAML config into the flags it stands for.

    Raises:
        ConfigError: the file is missing or not a mapping, or has a key that is no flag.
    """
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of flag names to values")
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    argv: List[str] = []
    for key, value in _flatten(data).items():
        flag = f"--{key}"
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise ConfigError(f"unknown key '{key}' in {path} (no flag {flag})")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"key '{key}' in {path} must be true or false, got {value!r}")
            if value:
                argv.append(flag)
        elif value is None:
            continue
        elif isinstance(value, list):
            argv += [flag] + [str(v) for v in value]
        else:
            argv += [flag, str(value)]
    return argv


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


def _require(args: argparse.Namespace, names: Sequence[str]) -> None:
    for name in names:
        if getattr(args, name) is None:
            flag = name.replace("_", "-")
            raise ConfigError(f"--{flag} is required (a flag, or the key '{flag}' in --config)")


def _check_positive(args: argparse.Namespace, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _check_failure_flags(args: argparse.Namespace, world_size: int) -> None:
    """Fault injection and hang/straggler detection: bad values stop the job here."""
    from megatron.training.faults import faults_from_args
    from megatron.training.monitor import MonitorConfig
    specs = faults_from_args(args, world_size)
    for spec in specs:  # FaultSpec refuses slow <= 0 and NaN; an endless sleep is no fault
        if not math.isfinite(spec.slow_s) or spec.slow_s > MAX_TIMEOUT_S:
            raise ConfigError(f"--moc-fault {spec.text}: slow must be a finite number of "
                              f"seconds > 0, at most {MAX_TIMEOUT_S:g}, got {spec.slow_s:g}")
    kinds = {spec.kind for spec in specs}
    from megatron.training.stage_loss import check_stage_loss
    check_stage_loss(args, specs)
    # Checked here, on every rank: the injector finds out only on the fault's own rank,
    # after the process group exists (the others then hang), or never fires them.
    two_level = getattr(args, "moc_two_level", False)
    exact = getattr(args, "moc_mode", "pec") == "exact"
    if "lose-memory" in kinds and not (two_level or exact):
        raise ConfigError("--moc-fault lose-memory needs in-memory snapshots (--moc-two-level, "
                          "or --moc-mode exact's frames): there is nothing to lose")
    for kind in ("snapshot-crash", "persist-crash"):
        if kind in kinds and not two_level:
            raise ConfigError(f"--moc-fault {kind} needs --moc-two-level: without it there is "
                              f"no snapshot (or keeper persist) for the fault to fire in")
    if (args.moc_fault or args.moc_fault_mtbf is not None) and \
            (not args.save or "://" in args.save):
        raise ConfigError("--moc-fault/--moc-fault-mtbf need a local --save: the record of "
                          "fired faults lives there, so a restarted job does not fire them again")
    if args.moc_monitor:
        MonitorConfig.from_args(args)


def _check_output_file(flag: str, path: Optional[str]) -> None:
    """A file the job appends to (rank 0, after loading): refused here, on every rank,
    when it cannot be created, rather than failing on rank 0 alone later while the other
    ranks wait for it in a collective."""
    if not path or "://" in path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; name a file")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # created when the file is first written
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot create it ({parent} is not a writable "
                          f"directory)")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path}: not writable")


def _check_storage_urls(args: argparse.Namespace) -> None:
    """``--save``/``--load`` may be fsspec URLs (``s3://...``) with --moc-checkpoint only,
    and the URL's filesystem package must be importable: fail here, not at the first save
    hours into the run."""
    from deepspeed_ext.format import fs
    for flag in ("save", "load"):
        value = getattr(args, flag)
        if not value or not fs.is_url(value):
            continue
        if not args.moc_checkpoint:
            raise ConfigError(f"--{flag} {value}: storage URLs need --moc-checkpoint (DeepSpeed's "
                              f"own checkpoints are written to local paths only)")
        try:
            fs.check_location(value)
        except ValueError as err:
            raise ConfigError(f"--{flag}: {err}") from None


def _check_redundancy(args: argparse.Namespace, world_size: int) -> None:
    """``--moc-redundancy`` and its counts against the node layout (every rank)."""
    from deepspeed_ext.policy import redundancy as rd
    try:
        spec = rd.RedundancySpec(args.moc_redundancy, args.moc_replicas, args.moc_ec_data,
                                 args.moc_ec_parity)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if args.moc_redundancy_interval < 1:
        raise ConfigError(f"--moc-redundancy-interval must be >= 1, got "
                          f"{args.moc_redundancy_interval}")
    if not spec.enabled:
        return
    if not args.moc_two_level:
        raise ConfigError(f"--moc-redundancy {spec.mode} protects two-level snapshots: add "
                          "--moc-two-level")
    from deepspeed_ext.node_layout import ranks_per_node
    per_node = ranks_per_node(args.moc_ranks_per_node, world_size)
    try:
        rd.check_layout(spec, rd.Topology(world_size, per_node))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def keeper_socket_path(shm_dir: str, node: int) -> str:
    """The Unix socket the keeper of node ``node`` listens on under the job's shared-memory
    directory (``<shm dir>/node<N>/keeper.sock``)."""
    from deepspeed_ext.keeper import SOCKET_NAME
    return os.path.join(shm_dir, f"node{node}", SOCKET_NAME)


def check_keeper_socket_path(shm_dir: str, max_node: int, flag: str = "--moc-shm-dir") -> None:
    """Refuse a shared-memory directory whose keeper socket path (for the node with the
    largest index, ``max_node``) is longer than a Unix socket path may be: binding it fails
    inside the keeper, and the ranks would wait for it in vain.

    Raises:
        ConfigError: naming ``flag``, the socket path's length and the limit.
    """
    path = keeper_socket_path(shm_dir, max_node)
    length = len(os.fsencode(path))
    if length > UNIX_SOCKET_PATH_MAX:
        raise ConfigError(f"{flag} {shm_dir} is too long: the keeper of node {max_node} would "
                          f"listen on {path}, {length} bytes, and a Unix socket path holds at "
                          f"most {UNIX_SOCKET_PATH_MAX}; use a directory at least "
                          f"{length - UNIX_SOCKET_PATH_MAX} bytes shorter")


def effective_shm_dir(args: argparse.Namespace) -> Optional[str]:
    """The shared-memory directory the job uses: ``--moc-shm-dir``, else derived from
    ``--save`` (two-level snapshots or exact mode's frames); None when it uses none."""
    if args.moc_two_level:
        source = args.save or args.load
    elif args.moc_mode == "exact":
        source = args.save
    else:
        return None
    if args.moc_shm_dir:
        return args.moc_shm_dir
    if not source:
        return None
    from deepspeed_ext.two_level import default_shm_dir
    return default_shm_dir(source)


def _nodes_max_index(args: argparse.Namespace, world_size: int) -> int:
    """The largest node index of the job, computed as the keepers place ranks."""
    from deepspeed_ext.node_layout import ranks_per_node
    per_node = ranks_per_node(args.moc_ranks_per_node, world_size)
    return (max(world_size, 1) - 1) // max(per_node, 1)


def _check_float(flag: str, value: Optional[float], unit: str = "", *, zero_ok: bool = False,
                 note: str = "", maximum: Optional[float] = None) -> None:
    """``value`` (None: not given) is finite and > 0 (>= 0 with ``zero_ok``), and at most
    ``maximum``; ``unit`` names what it counts (``seconds``), ``note`` what 0 means."""
    if value is None:
        return
    what = f"a finite number of {unit}" if unit else "a finite number"
    bound = ">= 0" if zero_ok else "> 0"
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise ConfigError(f"{flag} must be {what} {bound}{note}, got {value:g}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{flag} must be at most {maximum:g} {unit} (the longest wait "
                          f"Python can time), got {value:g}")


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts and durations that make no sense (negative, NaN, infinite): refused here,
    on every rank, instead of a traceback, a hang or an infinite wait later."""
    _check_float("--distributed-timeout-minutes", args.distributed_timeout_minutes, "minutes",
                 maximum=MAX_TIMEOUT_S / 60)
    _check_float("--moc-commit-timeout", args.moc_commit_timeout, "seconds",
                 maximum=MAX_TIMEOUT_S)
    _check_float("--moc-expected-mtbf", args.moc_expected_mtbf, "seconds", zero_ok=True,
                 note=" (0: unknown)")
    _check_float("--moc-host-memory-gb", args.moc_host_memory_gb, "GB", zero_ok=True,
                 note=" (0: unchecked)")
    _check_float("--moc-upstream-log-gb", getattr(args, "moc_upstream_log_gb", 0.0), "GB",
                 zero_ok=True, note=" (0: unchecked)")
    # Defined by the fault-injection and monitor groups (getattr: a parser without them).
    for name in ("moc_fault_mtbf", "moc_hang_timeout", "moc_monitor_poll"):
        _check_float(f"--{name.replace('_', '-')}", getattr(args, name, None), "seconds",
                     maximum=MAX_TIMEOUT_S)
    for name, least, meaning in (("moc_pec_k", 0, " (0: all experts)"),
                                 ("moc_k_persist", 0, " (0: all experts)"),
                                 ("moc_k_snapshot", 0, " (0: all experts)"),
                                 ("moc_keep", 0, " (0: keep all)"),
                                 ("moc_window", 0, " (0: automatic)"),
                                 ("moc_snapshot_interval", 0, " (0: --save-interval)"),
                                 ("moc_persist_interval", 1, ""),
                                 ("moc_ranks_per_node", 0, " (0: the launcher's count)"),
                                 ("moc_redundancy_interval", 1, ""),
                                 ("moc_restart_count", 0, ""),
                                 ("moc_checksum_threads", 0, " (0: automatic)")):
        value = getattr(args, name)
        if value is not None and value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {least}{meaning}, "
                              f"got {value}")
    # Every other float flag: NaN or infinity is never a meaningful setting.
    for name, value in sorted(vars(args).items()):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


def _check_moe_schedule(args: argparse.Namespace) -> None:
    """A Parm schedule rearranges the collectives of experts split over the
    tensor-parallel ranks: refuse it where there are none (``auto`` falls back to
    DeepSpeed's, with a log line)."""
    schedule = getattr(args, "moe_schedule", "deepspeed")
    if schedule in ("parm-s1", "parm-s2") and (
            getattr(args, "tensor_model_parallel_size", 1) == 1
            or not getattr(args, "enable_expert_tensor_parallelism", False) or args.num_experts <= 1):
        raise ConfigError(f"--moe-schedule {schedule} needs MoE layers (--num-experts > 1) with "
                          "experts split over the tensor-parallel ranks "
                          "(--tensor-model-parallel-size > 1 --enable-expert-tensor-parallelism)")
    if getattr(args, "moe_schedule_costs", None) and schedule != "auto":
        raise ConfigError("--moe-schedule-costs is read by --moe-schedule auto only")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the arguments against each other and the world size; fill derived values.

    Called on every rank before any collective, so every rank stops with the same
    message. Adds ``data_parallel_size`` and ``gradient_accumulation_steps``.

    Raises:
        ConfigError: naming the flag to fix.
    """
    _require(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "micro_batch_size", "train_iters", "lr"))
    _check_data_paths(args)
    _check_positive(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                           "micro_batch_size", "global_batch_size", "train_iters", "num_experts",
                           "moe_expert_parallel_size", "expert_interval", "log_interval",
                           "eval_interval", "make_vocab_size_divisible_by"))
    _check_numbers(args)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
                          f"({args.max_position_embeddings})")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size ({args.hidden_size}) must be divisible by "
                          f"--num-attention-heads ({args.num_attention_heads})")
    ep = args.moe_expert_parallel_size
    if args.num_experts % ep:
        raise ConfigError(f"--num-experts ({args.num_experts}) must be divisible by "
                          f"--moe-expert-parallel-size ({ep})")
    tp = getattr(args, "tensor_model_parallel_size", 1)
    stages = getattr(args, "pipeline_model_parallel_size", 1)
    if stages > 1 and world_size % stages:
        raise ConfigError(f"world size ({world_size}) must be divisible by "
                          f"--pipeline-model-parallel-size ({stages})")
    try:
        # a pipeline stage's ranks (world / P) are laid out as the whole world is without one
        dp = build_layout(world_size // max(stages, 1), tp, ep,
                          bool(getattr(args, "enable_expert_tensor_parallelism", False))).dp
    except ValueError as e:  # the message names the flag
        raise ConfigError(str(e)) from None
    if tp > 1:
        for flag, value in (("--num-attention-heads", args.num_attention_heads),
                            ("--ffn-hidden-size", args.ffn_hidden_size or 4 * args.hidden_size)):
            if value % tp:
                raise ConfigError(f"{flag} ({value}) must be divisible by "
                                  f"--tensor-model-parallel-size ({tp})")
    if args.num_experts > 1 and args.expert_interval > args.num_layers:
        raise ConfigError(f"--expert-interval ({args.expert_interval}) exceeds --num-layers "
                          f"({args.num_layers}): the model would have no MoE layer")
    if args.num_experts > 1 and args.topk > args.num_experts:
        raise ConfigError(f"--topk ({args.topk}) exceeds --num-experts ({args.num_experts})")
    args.data_parallel_size = dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ConfigError(f"--global-batch-size ({args.global_batch_size}) must be divisible by "
                          f"--micro-batch-size x data-parallel size ({args.micro_batch_size} x "
                          f"{dp} = {per_step})")
    args.gradient_accumulation_steps = args.global_batch_size // per_step
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr ({args.min_lr}) must be between 0 and --lr ({args.lr})")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ConfigError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than "
                          f"--lr-decay-iters ({args.lr_decay_iters})")
    for flag in ("save_interval", "exit_interval", "eval_iters", "num_workers", "num_threads"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.deepspeed_config and not os.path.isfile(args.deepspeed_config):
        raise ConfigError(f"--deepspeed_config: file not found: {args.deepspeed_config}")
    if args.deepspeed_config:
        from megatron.training.ds_config import reconcile_with_file
        reconcile_with_file(args)
    if args.hysteresis < 1:
        raise ConfigError(f"--hysteresis must be >= 1, got {args.hysteresis}")
    check_megatron_compat(args)
    _check_moe_schedule(args)
    infer_tokenizer(args)
    if args.moc_pec_k > args.num_experts:
        raise ConfigError(f"--moc-pec-k ({args.moc_pec_k}) exceeds --num-experts ({args.num_experts})")
    if args.moc_two_level and not args.moc_checkpoint:
        raise ConfigError("--moc-two-level needs --moc-checkpoint")
    if args.moc_mode == "exact":
        if not (args.moc_checkpoint and args.save):
            raise ConfigError("--moc-mode exact needs --moc-checkpoint and --save (its frames "
                              "go to <save>/exact)")
        if args.moc_two_level:
            raise ConfigError("--moc-mode exact does not combine with --moc-two-level yet")
        from deepspeed_ext.format import fs
        if fs.is_url(args.save):
            raise ConfigError(f"--moc-mode exact: --save {args.save} must be a local path")
    if getattr(args, "moc_upstream_logging", False) and (
            args.moc_mode != "exact" or getattr(args, "pipeline_model_parallel_size", 1) < 2):
        raise ConfigError("--moc-upstream-logging needs --moc-mode exact (a stage replays its "
                          "window from the logs) and --pipeline-model-parallel-size > 1")
    _check_redundancy(args, world_size)
    if args.moc_pec_scope != "wo" and args.moc_two_level:
        raise ConfigError(f"--moc-pec-scope {args.moc_pec_scope} is not supported with "
                          "--moc-two-level (use wo)")
    _check_storage_urls(args)
    if args.moc_dynamic_k and not args.moc_checkpoint:
        raise ConfigError("--moc-dynamic-k needs --moc-checkpoint")
    if not 0.0 < args.moc_plt_threshold < 1.0:
        raise ConfigError(f"--moc-plt-threshold must be in (0, 1), got {args.moc_plt_threshold}")
    if args.moc_event_file is None:
        from megatron.training.events import default_event_file
        args.moc_event_file = default_event_file(args.save) if args.moc_checkpoint else None
    _check_failure_flags(args, world_size)
    _check_output_file("--metrics-file", args.metrics_file)
    _check_output_file("--moc-event-file", args.moc_event_file)
    if args.moc_two_level and not (args.save or args.load or args.moc_shm_dir):
        raise ConfigError("--moc-two-level needs --save (or --moc-shm-dir) to name its memory")
    shm_dir = effective_shm_dir(args)
    if shm_dir:
        check_keeper_socket_path(shm_dir, _nodes_max_index(args, world_size),
                                 "--moc-shm-dir" if args.moc_shm_dir else
                                 "--moc-shm-dir (default, derived from --save)")
    if args.moc_k_snapshot > args.num_experts:
        raise ConfigError(f"--moc-k-snapshot ({args.moc_k_snapshot}) exceeds --num-experts "
                          f"({args.num_experts})")
    k_persist = args.moc_k_persist if args.moc_k_persist is not None else args.moc_pec_k
    if k_persist > args.num_experts:
        raise ConfigError(f"--moc-k-persist ({k_persist}) exceeds --num-experts "
                          f"({args.num_experts})")
    if args.moc_k_snapshot and k_persist > args.moc_k_snapshot:
        raise ConfigError(f"--moc-k-persist ({k_persist}) must not exceed --moc-k-snapshot "
                          f"({args.moc_k_snapshot})")
    if args.moc_checkpoint and args.zero_stage == 0 and (args.bf16 or args.fp16):
        raise ConfigError("--moc-checkpoint with --bf16/--fp16 needs --zero-stage 1 or 2 "
                          "(the fp32 master weights live in ZeRO's partitions)"
                          + (f"; --deepspeed_config {args.deepspeed_config} has ZeRO stage 0 "
                             "with " + ("fp16" if args.fp16 else "bf16") + ": set "
                             "zero_optimization.stage to 1 or 2 there"
                             if args.deepspeed_config else ""))
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        # Checked here, on every rank: failing later on rank 0 alone would leave the
        # other ranks waiting in the first collective.
        raise ConfigError("--tensorboard-dir needs the tensorboard package "
                          "(pip install tensorboard, or the project's [tensorboard] extra)")
    _check_wandb(args)
    for flag, dropout in (("--hidden-dropout", args.hidden_dropout),
                          ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {dropout}")
    return args


def _check_data_paths(args: argparse.Namespace) -> None:
    """One source of data: --data-path (carved by --split), or Megatron-DeepSpeed's
    separate --train-data-path/--valid-data-path/--test-data-path."""
    separate = [f"--{name}-data-path" for name in ("train", "valid", "test")
                if getattr(args, f"{name}_data_path", None)]
    if args.data_path is None and not separate:
        raise ConfigError("--data-path is required (a flag, or the key 'data-path' in "
                          "--config), or --train-data-path for separate datasets")
    if args.data_path is not None and separate:
        raise ConfigError(f"--data-path and {'/'.join(separate)} both name the data: give "
                          "--data-path (split by --split) or separate datasets, not both")
    if separate and "--train-data-path" not in separate:
        raise ConfigError(f"{'/'.join(separate)} needs --train-data-path (the training set)")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Round the tokenizer's vocabulary up to a multiple of ``--make-vocab-size-divisible-by``
    times the tensor-parallel size (as Megatron does: each rank's vocabulary slice is then
    a multiple of the former)."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def moc_config_from_args(args: argparse.Namespace):
    """The :class:`deepspeed_ext.config.MoCConfig` of ``--moc-*`` (or the ``moc:`` YAML section)."""
    from deepspeed_ext.config import MoCConfig
    shm_dir = (effective_shm_dir(args) or "") if args.moc_two_level else ""
    pec_k = args.moc_k_persist if args.moc_k_persist is not None else args.moc_pec_k
    return MoCConfig(pec_k=pec_k, pec_policy=args.moc_pec_policy, pec_scope=args.moc_pec_scope,
                     keep=args.moc_keep, commit_timeout_s=args.moc_commit_timeout,
                     async_save=not args.moc_sync_save, two_level=args.moc_two_level,
                     k_snapshot=args.moc_k_snapshot, persist_interval=args.moc_persist_interval,
                     shm_dir=shm_dir, save_dir=args.save or args.load or "",
                     ranks_per_node=args.moc_ranks_per_node,
                     host_memory_gb=args.moc_host_memory_gb,
                     checksum_threads=args.moc_checksum_threads, redundancy=args.moc_redundancy,
                     replicas=args.moc_replicas, ec_data=args.moc_ec_data,
                     ec_parity=args.moc_ec_parity,
                     redundancy_interval=args.moc_redundancy_interval,
                     padded_vocab=padded_vocab_from_args(args))


VOCAB_TENSORS = ("word_embeddings.weight",)
"""The model's tensors whose rows are the padded vocabulary: the word embedding, which is
also the output layer (tied)."""


def padded_vocab_from_args(args: argparse.Namespace):
    """The :class:`deepspeed_ext.format.vocab.PaddedVocab` of the model (a MoC load under
    another padding trims or adds its padding rows); None while the tokenizer's size
    (``args.true_vocab_size``, set beside ``args.padded_vocab_size`` once the tokenizer is
    built) is not known."""
    from deepspeed_ext.format.vocab import PaddedVocab
    real = getattr(args, "true_vocab_size", None)
    if real is None or getattr(args, "padded_vocab_size", None) is None:
        return None
    return PaddedVocab(VOCAB_TENSORS, args.padded_vocab_size, real)


def model_config_from_args(args: argparse.Namespace):
    """The :class:`~megatron.model.config.GPTMoEConfig` the arguments describe."""
    from megatron.model.config import GPTMoEConfig
    return GPTMoEConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=args.padded_vocab_size,
        max_position_embeddings=args.max_position_embeddings, ffn_hidden_size=args.ffn_hidden_size,
        position_embedding_type=args.position_embedding_type, num_experts=args.num_experts,
        expert_interval=args.expert_interval, moe_expert_parallel_size=args.moe_expert_parallel_size,
        topk=args.topk, moe_train_capacity_factor=args.moe_train_capacity_factor,
        moe_eval_capacity_factor=args.moe_eval_capacity_factor,
        moe_min_capacity=args.moe_min_capacity,
        moe_token_dropping=not args.disable_moe_token_dropping, moe_loss_coeff=args.moe_loss_coeff,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, layernorm_epsilon=args.layernorm_epsilon,
        seed=args.seed,
        tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        enable_expert_tensor_parallelism=bool(getattr(args, "enable_expert_tensor_parallelism", False)),
        checkpoint_activations=bool(getattr(args, "checkpoint_activations", False)
                                    or getattr(args, "deepspeed_activation_checkpointing", False)))
