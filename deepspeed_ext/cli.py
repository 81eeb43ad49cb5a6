"""``moc-ckpt``: inspect, verify and consolidate MoC checkpoints without DeepSpeed.

Examples::

    moc-ckpt inspect  checkpoints/                 # every checkpoint, expert ages
    moc-ckpt verify   checkpoints/ [--tag T]       # exit 1 on any problem
    moc-ckpt consolidate checkpoints/ --out model.safetensors [--optimizer]
    moc-ckpt densify  checkpoints/ --out dense/    # exact-mode frames -> a checkpoint

Exit status: 0 fine, 1 a checkpoint has problems (verify, consolidate), 2 bad input
(missing directory, unknown tag, bad arguments).
"""

import argparse
import os
import re
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from deepspeed_ext import fs
from deepspeed_ext.manifest import (MANIFEST_FILE, SET_ASIDE_PREFIX, Manifest, read_latest,
                                    read_manifest, scan_checkpoints, verify_checkpoint)
from deepspeed_ext.reader import CheckpointReader, find_loadable
from deepspeed_ext.storage import CheckpointError, write_safetensors_streaming

WEIGHTS_KIND = "fp32"
"""Kind of the fp32 master weights: the model a consolidated file holds."""


class UsageError(Exception):
    """Bad command-line input (exit status 2)."""


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"  # pragma: no cover


def _check_dir(path: str) -> None:
    try:
        found = fs.isdir(path)
    except ValueError as err:  # a URL fsspec cannot open
        raise UsageError(str(err)) from None
    if not found:
        raise UsageError(f"{path} is not a directory (pass the checkpoint save directory)")


def _check_tag_dir(save_dir: str, tag: Optional[str]) -> None:
    if tag is not None and not fs.isdir(os.path.join(save_dir, tag)):
        raise UsageError(f"no checkpoint {tag!r} in {save_dir} (--tag)")


# ------------------------------------------------------------------------- inspect

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
        lines.append(f"  bytes per rank: max {_size(per_rank[busiest])} (rank {busiest}), "
                     f"mean {_size(total / len(per_rank))}, total {_size(total)} in "
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
    _check_dir(args.dir)
    _check_tag_dir(args.dir, args.tag)
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


# -------------------------------------------------------------------------- verify

def cmd_verify(args: argparse.Namespace) -> int:
    _check_dir(args.dir)
    _check_tag_dir(args.dir, args.tag)
    checksums = not args.no_checksums
    results: List[Tuple[str, List[str]]] = []
    if args.tag is not None:
        results.append((args.tag, verify_checkpoint(args.dir, args.tag, checksums)))
    else:
        scan = scan_checkpoints(args.dir)
        if not scan.complete and not scan.corrupt:
            raise UsageError(f"no complete checkpoint in {args.dir}")
        for _, tag in scan.complete:
            results.append((tag, verify_checkpoint(args.dir, tag, checksums)))
        for tag, err in scan.corrupt:
            results.append((tag, [err]))
        try:
            latest = read_latest(args.dir)
            if latest is not None and latest not in {t for _, t in scan.complete}:
                results.append(("latest", [f"{os.path.join(args.dir, 'latest')} names "
                                           f"{latest!r}, which is not a complete checkpoint"]))
        except CheckpointError as err:
            results.append(("latest", [str(err)]))
        if scan.incomplete:
            print(f"not verified, incomplete (no {MANIFEST_FILE}): {', '.join(scan.incomplete)}")
    failed = 0
    for tag, problems in results:
        if problems:
            failed += 1
            print(f"FAILED {tag}")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"OK     {tag}")
    if failed:
        print(f"{failed} of {len(results)} failed")
    return 1 if failed else 0


# --------------------------------------------------------------------- consolidate

def cmd_consolidate(args: argparse.Namespace) -> int:
    _check_dir(args.dir)
    _check_tag_dir(args.dir, args.tag)
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
            _stderr(f"warning: {line}")
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
          f"{_size(record.nbytes)}")
    return 0


# ---------------------------------------------------------------------------- densify

def _frames_world_size(save_dir: str) -> Optional[int]:
    """The world size the newest readable frame marker under ``save_dir`` records. Any
    rank's will do: after a crash the newest frame often lacks rank 0's marker (its
    node's keeper had not copied it yet) while complete windows lie behind it."""
    from deepspeed_ext import exact
    for frame in reversed(exact.list_frames(save_dir)):
        try:
            names = sorted(os.listdir(exact.frame_dir(save_dir, frame)))
        except OSError:
            continue
        for name in names:
            m = re.match(r"^rank(\d{5,})\.json$", name)
            record = exact.read_marker(save_dir, frame, int(m.group(1))) if m else None
            if record is not None and "world_size" in record:
                return int(record["world_size"])
    return None


def cmd_densify(args: argparse.Namespace) -> int:
    """Replay the newest complete window of exact-mode frames under ``args.dir`` with the
    training command that took them, on one machine, and leave the dense state at the
    window's end as a checkpoint in ``args.out``."""
    import subprocess
    from deepspeed_ext import exact
    _check_dir(args.dir)
    world_size = _frames_world_size(args.dir)
    if world_size is None:
        raise UsageError(f"{os.path.join(args.dir, exact.EXACT_DIR)} holds no frames "
                         f"(was the run trained with --moc-mode exact?)")
    found = exact.find_window(args.dir, world_size)
    if found is None:
        raise UsageError(f"{args.dir}: no window of frames is complete on storage")
    end = found.start + found.window
    latest = read_latest(args.dir)
    if latest is not None and latest.startswith("global_step") and \
            int(latest[len("global_step"):]) >= end:
        raise UsageError(f"{args.dir} already has checkpoint {latest}, at or after the "
                         f"frames' end (iteration {end}): nothing to densify")
    record = exact.read_marker(args.dir, found.start, 0)
    command = record.get("command")
    if not command:
        raise UsageError(f"frame {found.start} does not record the training command; "
                         f"densify needs frames written by pretrain_gpt_moe.py")
    if os.path.exists(args.out) and os.listdir(args.out):
        raise UsageError(f"--out {args.out} is not empty")
    # Memory of its own: with the run's --moc-shm-dir the replay would attach to that
    # job's keeper, prefer its memory frames over the storage window chosen here, and
    # delete that memory at its end while the job may still be restarting.
    shm = tempfile.mkdtemp(prefix="moc-densify-",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(found.world_size), *command,
           "--load", os.path.abspath(args.dir), "--save", os.path.abspath(args.out),
           "--moc-shm-dir", shm, "--exit-interval", str(end)]
    print(f"replaying iterations {found.start + 1}..{end} of {args.dir} on "
          f"{found.world_size} local processes:\n  {' '.join(cmd)}", flush=True)
    try:
        if args.dry_run:
            return 0
        code = subprocess.call(cmd, cwd=record.get("cwd") or None)  # its relative paths
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    tag = f"global_step{end}"
    if code != 0 or read_latest(args.out) != tag:
        _stderr(f"error: the replay exited with status {code}; no checkpoint {tag} in {args.out}")
        return 1
    print(f"wrote {os.path.join(args.out, tag)}: the exact state at iteration {end}")
    return 0


# ---------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moc-ckpt", description="Inspect, verify and consolidate MoC checkpoints.")
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
    p.set_defaults(func=cmd_consolidate)
    p = sub.add_parser("densify", help="replay exact-mode frames into a checkpoint at the "
                                       "end of their newest complete window")
    p.add_argument("dir", help="the run's --save directory (holds exact/)")
    p.add_argument("--out", required=True, help="new directory for the checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the replay command only")
    p.set_defaults(func=cmd_densify)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 1 problems, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed the usage error
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return args.func(args)
    except UsageError as err:
        _stderr(f"error: {err}")
        return 2
    except CheckpointError as err:
        _stderr(f"error: {err}")
        return 1
    except KeyboardInterrupt:
        _stderr("interrupted")
        return 130


def main_cli() -> None:
    """Console-script entry point (``moc-ckpt``)."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
