"""``moc-ckpt consolidate``: the full fp32 model of a checkpoint (each expert's newest
version), optionally with its optimizer state, streamed into one safetensors file.

The tensors are whole (no tensor-parallel split), so they suit any tensor-parallel size
except for the padded vocabulary, whose rows follow it (Megatron pads to a multiple of
``--make-vocab-size-divisible-by`` x T): ``--padded-vocab-size N`` writes the tensors the
checkpoint records as a padded vocabulary with N rows, its padding rows trimmed or zero
rows added (:mod:`deepspeed_ext.format.vocab`); N = the vocabulary size writes its token
rows only."""

import argparse
import os
from typing import Dict, Optional, Tuple

from deepspeed_ext.cli.common import UsageError, check_dir, check_tag_dir, size_text, stderr
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.storage import write_safetensors_streaming
from deepspeed_ext.format.vocab import OBJECTS_KEY, PaddedVocab, RowPlan
from deepspeed_ext.store.reader import CheckpointReader, find_loadable, vocab_plan

WEIGHTS_KIND = "fp32"
"""Kind of the fp32 master weights: the model a consolidated file holds."""


def cmd_consolidate(args: argparse.Namespace) -> int:
    """``moc-ckpt consolidate DIR --out F.safetensors [--tag T] [--optimizer]
    [--padded-vocab-size N]`` (run by :func:`deepspeed_ext.cli.main.main`); returns the
    exit status."""
    check_dir(args.dir)
    check_tag_dir(args.dir, args.tag)
    _check_out(args.out)
    if args.tag is not None:
        tag, verified = args.tag, False
    else:
        tag, skipped = find_loadable(args.dir, checksums=True)
        for line in skipped:
            stderr(f"warning: {line}")
        if tag is None:
            raise UsageError(f"no checkpoint in {args.dir}")
        verified = True
    with CheckpointReader(args.dir, tag, verify_checksums=not verified) as reader:
        sources = _sources(reader, tag, args.optimizer)
        saved_vocab, plan = _vocab(reader, tag, getattr(args, "padded_vocab_size", None))
        rows = {name: plan.rows for name in plan.names} if plan is not None else {}
        layout = []
        for key, (name, kind) in sources.items():
            info = reader.info(name, kind)
            shape = (rows[name],) + info.shape[1:] if name in rows else info.shape
            layout.append((key, shape, info.dtype))
        metadata = {"format": "moc-consolidated", "tag": tag, "step": str(reader.step)}
        if saved_vocab is not None:
            metadata.update(vocab_size=str(saved_vocab.real_rows),
                            padded_vocab_size=str(plan.rows if plan else saved_vocab.rows))
        record = write_safetensors_streaming(
            args.out, layout,
            lambda key: reader.read_full(*sources[key], rows=rows.get(sources[key][0])),
            metadata=metadata)
    if plan is not None:
        print(plan.describe())
    print(f"wrote {args.out}: {len(layout)} tensors from {tag} (step {reader.step}), "
          f"{size_text(record.nbytes)}")
    return 0


def _check_out(out: str) -> None:
    """Refuse an ``--out`` that is not a local ``.safetensors`` path in an existing
    directory (UsageError)."""
    if not out.endswith(".safetensors"):
        raise UsageError(f"--out {out}: the output must be a .safetensors file")
    if fs.is_url(out):
        raise UsageError(f"--out {out}: write the consolidated file to a local path "
                         f"(it is streamed tensor by tensor), then copy it to the store")
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--out {out}: directory {out_dir} does not exist")


def _sources(reader: CheckpointReader, tag: str, optimizer: bool) -> Dict[str, Tuple[str, str]]:
    """Output key -> ``(name, kind)``: the weights by name, with ``optimizer`` every other
    kind as ``<name>.<kind>``."""
    names = reader.tensor_names(WEIGHTS_KIND)
    if not names:
        raise CheckpointError(f"checkpoint {tag} holds no {WEIGHTS_KIND!r} tensors")
    sources: Dict[str, Tuple[str, str]] = {name: (name, WEIGHTS_KIND) for name in names}
    if optimizer:
        for name, kind in reader.keys():
            if kind == WEIGHTS_KIND:
                continue
            key = f"{name}.{kind}"
            if key in sources:
                raise CheckpointError(f"output key {key!r} would hold both "
                                      f"{sources[key]} and {(name, kind)}")
            sources[key] = (name, kind)
    return sources


def _vocab(reader: CheckpointReader, tag: str,
           rows: Optional[int]) -> Tuple[Optional[PaddedVocab], Optional[RowPlan]]:
    """The checkpoint's padded vocabulary record, and the plan that writes it with
    ``rows`` rows (None: as saved, or ``rows`` None).

    Raises:
        UsageError: ``rows`` given for a checkpoint without the record, or below its
            vocabulary's token count (only padding rows can go).
        CheckpointError: a malformed record.
    """
    try:
        saved = PaddedVocab.from_record((reader.objects() or {}).get(OBJECTS_KEY))
    except ValueError as err:
        raise CheckpointError(f"checkpoint {tag}: {err}") from None
    if rows is None:
        return saved, None
    if saved is None:
        raise UsageError(f"--padded-vocab-size: checkpoint {tag} records no padded vocabulary "
                         f"(saved without one, by an older MoC or a model that describes "
                         f"none); its tensors can only be written as saved")
    if rows < saved.real_rows:
        raise UsageError(f"--padded-vocab-size {rows}: the vocabulary has {saved.real_rows} "
                         f"tokens ({saved.rows} rows saved); only padding rows can be trimmed, "
                         f"so give at least {saved.real_rows}")
    target = PaddedVocab(saved.names, rows, saved.real_rows)
    return saved, vocab_plan(reader, target, saved.to_record())
