"""``--load`` naming a Megatron-DeepSpeed checkpoint: imported into ``--save`` as a MoC
checkpoint (``moc-ckpt import``'s code, :mod:`deepspeed_ext.interop`), then loaded from
there.

Every rank calls :func:`redirect_upstream_load` before the load; rank 0 alone reads and
writes, and its outcome (or error) reaches every rank in one broadcast. The upstream
directory is only read. A restarted job finds the import in ``--save`` and resumes from
it (and from the checkpoints saved after it).
"""

import argparse
import os
import traceback
from typing import Optional

import torch.distributed as dist

from deepspeed_ext.format import fs
from deepspeed_ext.runtime.groups import metadata_group
from megatron.errors import ConfigError
from megatron.training.log import print_rank_0

MODEL_FILE = "mp_rank_00_model_states.pt"
OWN_FILES = ("megatron_meta.json", "manifest.json")
"""Files only this trainer's checkpoints have (a baseline DeepSpeed-format one, a MoC one)."""


def redirect_upstream_load(args: argparse.Namespace) -> None:
    """Every rank, before the load: when ``--load`` holds a Megatron-DeepSpeed checkpoint,
    rank 0 imports it into ``--save`` and ``args.load`` becomes ``--save`` on every rank.

    Raises:
        ConfigError: on every rank, when the import cannot go into ``--save`` (none, the
            same directory, no ``--moc-checkpoint``) or the checkpoint cannot be imported
            (an architecture MoC does not train yet, a damaged file), naming the fix.
    """
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [("ok", import_target(args))]
        except ConfigError as err:
            outcome = [("config", str(err))]
        except Exception as err:  # reported to every rank below
            traceback.print_exc()
            outcome = [("config", f"--load {args.load}: importing the Megatron-DeepSpeed "
                                  f"checkpoint failed: {type(err).__name__}: {err}")]
    dist.broadcast_object_list(outcome, src=0, group=metadata_group())
    kind, value = outcome[0]
    if kind == "config":
        raise ConfigError(value)
    if value is not None:
        args.load = value


def upstream_tag(load_dir: str) -> Optional[str]:
    """The tag of the Megatron-DeepSpeed checkpoint ``latest`` names in ``load_dir``, or
    None when ``load_dir`` holds no such checkpoint (none, or this trainer's own)."""
    if not load_dir or fs.is_url(load_dir) or not os.path.isfile(os.path.join(load_dir, "latest")):
        return None
    from deepspeed_ext.interop.upstream import resolve_tag
    try:
        tag = resolve_tag(load_dir, None)
    except Exception:  # not a tag: the ordinary load names the problem
        return None
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(tag_dir, MODEL_FILE)) or any(
            os.path.exists(os.path.join(tag_dir, name)) for name in OWN_FILES):
        return None
    return tag


def import_target(args: argparse.Namespace) -> Optional[str]:
    """Rank 0 (:func:`redirect_upstream_load` sends the outcome to every rank): the
    directory to load from instead of ``--load`` (None: ``--load`` as is), the import
    written there first.

    Raises:
        ConfigError: naming what to change.
    """
    tag = upstream_tag(args.load)
    if tag is None:
        return None
    source = os.path.join(args.load, tag)
    hint = f"or import it yourself: moc-ckpt import {args.load} --out NEW_DIR, then --load NEW_DIR"
    if not getattr(args, "moc_checkpoint", False):
        raise ConfigError(f"--load {args.load} holds a Megatron-DeepSpeed checkpoint ({tag}); "
                          f"add --moc-checkpoint to import it into --save, {hint}")
    save = args.save
    if not save or fs.is_url(save) or os.path.realpath(save) == os.path.realpath(args.load):
        raise ConfigError(f"--load {args.load} holds a Megatron-DeepSpeed checkpoint ({tag}); "
                          f"give --save a new local directory to import it into, {hint}")
    if os.path.isfile(os.path.join(save, "latest")):
        print_rank_0(f"> --load {args.load} is a Megatron-DeepSpeed checkpoint and --save "
                     f"{save} already holds MoC checkpoints (its import, or newer): "
                     f"resuming from --save")
        return save
    from deepspeed_ext.interop.moc_write import ImportLayout, write_moc_checkpoint
    from deepspeed_ext.interop.upstream import read_upstream
    try:
        ckpt = read_upstream(args.load, tag)
    except ValueError as err:  # an architecture MoC does not train yet
        raise ConfigError(f"--load {args.load}: {err}") from None
    layout = ImportLayout(world_size=dist.get_world_size(),
                          ep_size=args.moe_expert_parallel_size)
    write_moc_checkpoint(save, ckpt, layout)
    state = "weights and Adam's moments" if ckpt.moments else "weights only"
    print_rank_0(f"> imported Megatron-DeepSpeed checkpoint {source} (iteration "
                 f"{ckpt.iteration}, {state}) into --save {save}; loading it from there")
    return save
