"""``moc-ckpt consolidate``: the full fp32 model of a checkpoint (each expert's newest
version), optionally with its optimizer state, streamed into one safetensors file."""

import argparse
import os
from typing import Dict, Tuple

from deepspeed_ext.cli.common import UsageError, check_dir, check_tag_dir, size_text, stderr
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.storage import write_safetensors_streaming
from deepspeed_ext.store.reader import CheckpointReader, find_loadable

WEIGHTS_KIND = "fp32"
"""Kind of the fp32 master weights: the model a consolidated file holds."""


def cmd_consolidate(args: argparse.Namespace) -> int:
    """``moc-ckpt consolidate DIR --out F.safetensors [--tag T] [--optimizer]`` (run by
    :func:`deepspeed_ext.cli.main.main`); returns the exit status."""
    check_dir(args.dir)
    check_tag_dir(args.dir, args.tag)
    if not args.out.endswith(".safetensors"):
        raise UsageError(f"--out {args.out}: the output must be a .safetensors file")
    if fs.is_url(args.out):
        raise UsageError(f"--out {args.out}: write the consolidated file to a local path "
                         f"(it is streamed tensor by tensor), then copy it to the store")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--out {args.out}: directory {out_dir} does not exist")
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
        names = reader.tensor_names(WEIGHTS_KIND)
        if not names:
            raise CheckpointError(f"checkpoint {tag} holds no {WEIGHTS_KIND!r} tensors")
        sources: Dict[str, Tuple[str, str]] = {name: (name, WEIGHTS_KIND) for name in names}
        if args.optimizer:
            for name, kind in reader.keys():
                if kind == WEIGHTS_KIND:
                    continue
                key = f"{name}.{kind}"
                if key in sources:
                    raise CheckpointError(f"output key {key!r} would hold both "
                                          f"{sources[key]} and {(name, kind)}")
                sources[key] = (name, kind)
        layout = []
        for key, (name, kind) in sources.items():
            info = reader.info(name, kind)
            layout.append((key, info.shape, info.dtype))
        record = write_safetensors_streaming(
            args.out, layout, lambda key: reader.read_full(*sources[key]),
            metadata={"format": "moc-consolidated", "tag": tag, "step": str(reader.step)})
    print(f"wrote {args.out}: {len(layout)} tensors from {tag} (step {reader.step}), "
          f"{size_text(record.nbytes)}")
    return 0
