"""``moc-ckpt import``: a Megatron-DeepSpeed MoE checkpoint (DeepSpeed's format, ZeRO
stage 1 or 2, expert parallelism) written as a MoC checkpoint that MoC's trainer loads
with ``--load`` at any layout, optimizer state included when the checkpoint has it.

Nothing pickled in the checkpoint runs: every file is read with ``weights_only=True``
and a short allow-list (:mod:`deepspeed_ext.interop.safe_load`)."""

import argparse
import logging
import os
import sys

from deepspeed_ext.cli.common import UsageError, check_dir, size_text
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.interop.moc_write import ImportLayout, all_tensors, write_moc_checkpoint
from deepspeed_ext.interop.upstream import read_upstream


def add_import_parser(sub) -> None:
    """The ``import`` subcommand's flags (called by :func:`deepspeed_ext.cli.main.build_parser`)."""
    p = sub.add_parser("import", help="write a Megatron-DeepSpeed MoE checkpoint as a MoC "
                                      "checkpoint (weights, optimizer state, counters)")
    p.add_argument("dir", help="Megatron-DeepSpeed's --save directory (holds 'latest')")
    p.add_argument("--out", required=True, help="new MoC save directory (give it to the "
                                                "trainer's --load)")
    p.add_argument("--tag", default=None, help="upstream checkpoint to import (default: "
                                               "the one 'latest' names)")
    p.add_argument("--world-size", type=int, default=None, metavar="W",
                   help="write the files as a W-rank job would (default: the upstream "
                        "run's data-parallel size); any layout loads it")
    p.add_argument("--expert-parallel-size", type=int, default=None, metavar="E",
                   help="expert-parallel size of that layout (default: the upstream run's)")
    p.add_argument("--weights-only", action="store_true",
                   help="leave the ZeRO optimizer files unread (Adam's moments start "
                        "from zero)")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    """``moc-ckpt import DIR --out OUT`` (run by :func:`deepspeed_ext.cli.main.main`);
    returns the exit status."""
    check_dir(args.dir)
    _check_out(args.out)
    _show_library_lines()
    try:
        ckpt = read_upstream(args.dir, args.tag, weights_only=args.weights_only)
    except ValueError as err:  # an architecture MoC cannot train yet
        raise CheckpointError(f"{args.dir}: {err}") from None
    model = ckpt.model
    layout = ImportLayout(world_size=args.world_size or model.dp_world_size,
                          ep_size=args.expert_parallel_size or model.ep_size)
    try:
        tag_dir = write_moc_checkpoint(args.out, ckpt, layout)
    except ValueError as err:
        raise UsageError(f"--world-size/--expert-parallel-size: {err}") from None
    nbytes = sum(t.numel() * t.element_size() for t in all_tensors(ckpt).values())
    state = ("weights and Adam's moments (ZeRO files)" if ckpt.moments else
             "weights only (no optimizer state)")
    print(f"imported {os.path.join(args.dir, ckpt.tag)} (iteration {ckpt.iteration}, "
          f"{ckpt.global_samples} samples): {len(ckpt.weights)} tensors, "
          f"{len(model.moe_layers)} MoE layers x {model.num_experts} experts, {state}")
    print(f"wrote {tag_dir}: {size_text(nbytes)} as {layout.world_size} ranks with "
          f"expert-parallel size {layout.ep_size}; train on with --load {args.out}")
    if ckpt.l2_weight_decay:
        print("upstream's optimizer added weight decay to the gradient (torch.optim.Adam, "
              "Megatron-DeepSpeed on a CPU): add --l2-weight-decay to continue it exactly")
    return 0


def _check_out(out: str) -> None:
    """Refuse an ``--out`` that is a URL or already holds a checkpoint (UsageError)."""
    if fs.is_url(out):
        raise UsageError(f"--out {out}: import into a local directory, then copy it")
    if os.path.exists(os.path.join(out, "latest")) or (
            os.path.isdir(out) and any(n.startswith("global_step") for n in os.listdir(out))):
        raise UsageError(f"--out {out} already holds checkpoints; import into a new "
                         f"directory")


class _CurrentStderr(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is when a record comes (a replaced one,
    a test's capture, never a closed one kept from an earlier call)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        """Ignored: the stream is always the current stderr."""


def _show_library_lines() -> None:
    """The interop modules' ``[moc]`` notes (stray tensors, weights only) on stderr."""
    logger = logging.getLogger("deepspeed_ext.interop")
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
