"""``moc-ckpt inspect``: steps, layout, saved experts, bytes per rank and expert ages of
the checkpoints in a save directory (read only; no DeepSpeed)."""

import argparse
import os
from typing import Dict, List

from deepspeed_ext.cli.common import check_dir, check_tag_dir, size_text
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.manifest import MANIFEST_FILE, Manifest, read_manifest
from deepspeed_ext.store.catalog import scan_checkpoints
from deepspeed_ext.store.latest import read_latest
from deepspeed_ext.store.prepare import SET_ASIDE_PREFIX


def _experts_text(experts) -> str:
    by_layer: Dict[int, List[int]] = {}
    for layer, expert in sorted(experts):
        by_layer.setdefault(layer, []).append(expert)
    if not by_layer:
        return "none"
    return " | ".join(f"layer {l}: {' '.join(map(str, es))}" for l, es in by_layer.items())


def _describe(manifest: Manifest) -> List[str]:
    lines = [f"{manifest.tag}  step {manifest.step}  world size {manifest.world_size}"]
    layout = " ".join(f"{k}={v}" for k, v in sorted(manifest.layout.items()))
    lines.append(f"  layout: {layout or '-'}")
    per_rank: Dict[int, int] = {}
    for entry in manifest.files.values():
        per_rank[entry.rank] = per_rank.get(entry.rank, 0) + entry.nbytes
    if per_rank:
        busiest = max(per_rank, key=per_rank.get)
        total = sum(per_rank.values())
        lines.append(f"  bytes per rank: max {size_text(per_rank[busiest])} (rank {busiest}), "
                     f"mean {size_text(total / len(per_rank))}, total {size_text(total)} in "
                     f"{len(manifest.files)} files")
    versions = manifest.expert_versions()
    whole = {e for e in manifest.held_experts()
             if e not in versions or versions[e].tags() == {manifest.tag}}
    lines.append(f"  experts saved here (step {manifest.step}): {_experts_text(whole)}")
    for part, name in (("w", "weights"), ("o", "optimizer state")):
        only = {e for e, v in versions.items()
                if e not in whole and v.part(part)[1] == manifest.tag}
        if only:  # a one-part PEC variant (--moc-pec-scope w or o)
            lines.append(f"  {name} only, of {len(only)} more expert(s)")
    return lines


def _ages(manifest: Manifest) -> List[str]:
    versions = manifest.expert_versions()
    if not versions:
        return [f"expert ages at {manifest.tag}: no MoE experts"]
    layers = sorted({l for l, _ in versions})
    experts = sorted({e for _, e in versions})
    ages = {k: manifest.step - v.oldest_step for k, v in versions.items()}
    width = max(4, len(str(max(ages.values()))) + 1)
    lines = [f"expert ages at {manifest.tag} (step {manifest.step}): steps since each "
             f"expert's newest whole saved version (weights and optimizer state)",
             "  layer\\expert" + "".join(f"{e:>{width}}" for e in experts)]
    for layer in layers:
        row = "".join(f"{ages[(layer, e)]:>{width}}" if (layer, e) in ages else " " * (width - 1)
                      + "-" for e in experts)
        lines.append(f"  {layer:<12}" + row)
    values = list(ages.values())
    lines.append(f"  max {max(values)}, mean {sum(values) / len(values):.1f}")
    return lines


def cmd_inspect(args: argparse.Namespace) -> int:
    """``moc-ckpt inspect DIR [--tag T]`` (run by :func:`deepspeed_ext.cli.main.main`):
    one checkpoint, or every one with the newest's expert ages; returns the exit status."""
    check_dir(args.dir)
    check_tag_dir(args.dir, args.tag)
    if args.tag is not None:
        manifest = read_manifest(os.path.join(args.dir, args.tag))
        print("\n".join(_describe(manifest) + [""] + _ages(manifest)))
        return 0
    scan = scan_checkpoints(args.dir)
    try:
        latest = read_latest(args.dir)
    except CheckpointError as err:
        latest = f"unreadable ({err})"
    print(f"{args.dir}: {len(scan.complete)} complete checkpoints, latest: {latest or '-'}")
    if scan.incomplete:
        print(f"incomplete (no {MANIFEST_FILE}): {', '.join(scan.incomplete)}")
    for tag, err in scan.corrupt:
        print(f"unreadable: {err}")
    aside = [n for n in fs.subdirs(args.dir) if n.startswith(SET_ASIDE_PREFIX)]
    if aside:
        print(f"set aside (an earlier attempt's abandoned timeline; MoC never reads or "
              f"deletes them): {', '.join(aside)}")
    if not scan.complete:
        return 0
    manifests = {tag: read_manifest(os.path.join(args.dir, tag)) for _, tag in scan.complete}
    for _, tag in scan.complete:
        print("")
        print("\n".join(_describe(manifests[tag])))
    newest = latest if latest in manifests else scan.complete[-1][1]
    print("")
    print("\n".join(_ages(manifests[newest])))
    return 0
