"""``moc-ckpt``'s argument parser and entry points: one subcommand per module of this
package."""

import argparse
import sys
from typing import Optional, Sequence

from deepspeed_ext.cli.common import UsageError, stderr
from deepspeed_ext.cli.consolidate import cmd_consolidate
from deepspeed_ext.cli.densify import cmd_densify
from deepspeed_ext.cli.export_cmd import add_export_parser
from deepspeed_ext.cli.import_cmd import add_import_parser
from deepspeed_ext.cli.inspection import cmd_inspect
from deepspeed_ext.cli.verify import cmd_verify
from deepspeed_ext.format.errors import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moc-ckpt", description="Inspect, verify, consolidate, import and export MoC checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="steps, layout, saved experts, bytes per rank, "
                                       "expert ages")
    p.add_argument("dir", help="checkpoint save directory (holds 'latest')")
    p.add_argument("--tag", default=None, help="one checkpoint (default: all)")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check files, checksums, coverage and expert index; "
                                      "exit 1 on any problem")
    p.add_argument("dir", help="checkpoint save directory")
    p.add_argument("--tag", default=None, help="one checkpoint (default: every complete one)")
    p.add_argument("--no-checksums", action="store_true",
                   help="check sizes and structure only (skip reading every byte)")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("consolidate", help="write the full fp32 model (newest expert "
                                           "versions) as one safetensors file")
    p.add_argument("dir", help="checkpoint save directory")
    p.add_argument("--tag", default=None,
                   help="checkpoint to read (default: the newest that verifies)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--optimizer", action="store_true",
                   help="also write every other kind (exp_avg, exp_avg_sq) as '<name>.<kind>'")
    p.add_argument("--padded-vocab-size", type=int, default=None, metavar="N",
                   help="write the padded-vocabulary tensors (word embedding, output layer) "
                        "with N rows: padding rows trimmed or zero rows added, for another "
                        "tensor-parallel size's padding; N = the vocabulary size: its token "
                        "rows only (default: as saved)")
    p.set_defaults(func=cmd_consolidate)
    p = sub.add_parser(
        "densify", help="replay exact-mode frames into a checkpoint at the end of their "
                        "newest complete window",
        usage="moc-ckpt densify [-h] dir --out OUT [--dry-run] [--hostfile FILE] "
              "[-- TRAINING FLAGS...]",
        description="Replay the newest complete window of exact-mode frames with this "
                    "project's pretrain_gpt_moe.py, on this machine or --hostfile's, into a checkpoint at "
                    "the window's end. The training flags are those given after --, or "
                    "else those the frames record, checked: only flags pretrain_gpt_moe.py "
                    "knows, with plain values (a recorded --config file is read and "
                    "checked too). Nothing a checkpoint records is run. densify sets "
                    "--load, --save, --moc-shm-dir and --exit-interval itself.")
    p.add_argument("dir", help="the run's --save directory (holds exact/)")
    p.add_argument("--out", required=True, help="new directory for the checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="print the replay command, run nothing")
    p.add_argument("--hostfile", default=None,
                   help="replay across these hosts with DeepSpeed's launcher (as many "
                        "slots as the run had ranks; default: this host, torchrun)")
    p.set_defaults(func=cmd_densify, train_args=None)
    add_import_parser(sub)
    add_export_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 1 problems, 2 bad input)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = None
    if argv[:1] == ["densify"] and "--" in argv:  # densify DIR --out OUT -- FLAGS...
        split = argv.index("--")
        argv, train_args = argv[:split], argv[split + 1:]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed the usage error
        return exit_.code if isinstance(exit_.code, int) else 2
    if train_args is not None:
        args.train_args = train_args
    try:
        return args.func(args)
    except UsageError as err:
        stderr(f"error: {err}")
        return 2
    except CheckpointError as err:
        stderr(f"error: {err}")
        return 1
    except KeyboardInterrupt:
        stderr("interrupted")
        return 130


def main_cli() -> None:
    """Console-script entry point (``moc-ckpt``)."""
    sys.exit(main())
