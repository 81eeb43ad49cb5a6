"""``moc-ckpt``: inspect, verify and consolidate MoC checkpoints without DeepSpeed.

Examples::

    moc-ckpt inspect  checkpoints/                 # every checkpoint, expert ages
    moc-ckpt verify   checkpoints/ [--tag T]       # exit 1 on any problem
    moc-ckpt consolidate checkpoints/ --out model.safetensors [--optimizer]
    moc-ckpt densify  checkpoints/ --out dense/    # exact-mode frames -> a checkpoint
    moc-ckpt densify  checkpoints/ --out dense/ -- --config my.yaml --data-path ...

Exit status: 0 fine, 1 a checkpoint has problems (verify, consolidate), 2 bad input
(missing directory, unknown tag, bad arguments).
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.format.manifest import MANIFEST_FILE, Manifest, read_manifest
from deepspeed_ext.format.naming import LATEST_FILE
from deepspeed_ext.format.storage import write_safetensors_streaming
from deepspeed_ext.store.catalog import scan_checkpoints
from deepspeed_ext.store.latest import read_latest
from deepspeed_ext.store.pins import reading
from deepspeed_ext.store.prepare import SET_ASIDE_PREFIX
from deepspeed_ext.store.reader import CheckpointReader, find_loadable
from deepspeed_ext.store.verify import verify_checkpoint

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

LATEST_READS = 5
"""How often ``moc-ckpt verify`` reads ``latest`` before it calls a ``latest`` naming no
complete checkpoint a problem (each read after the first follows a commit that moved it)."""


def _verify_pinned(save_dir: str, tag: str, checksums: bool) -> Optional[List[str]]:
    """Problems of checkpoint ``tag``, verified under a pin that keeps retention off it
    (:func:`deepspeed_ext.store.pins.reading`); None when it has no manifest once pinned (a
    committer's retention deleted it since it was listed: not damage)."""
    with reading(save_dir, tag):
        if not fs.exists(os.path.join(save_dir, tag, MANIFEST_FILE)):
            return None
        return verify_checkpoint(save_dir, tag, checksums)


def _verify_latest(save_dir: str, verified: set, checksums: bool,
                   results: List[Tuple[str, List[str]]]) -> None:
    """Check that ``latest`` names a complete checkpoint, verifying it when the listing
    did not hold it (committed since).

    A committer (a keeper, possibly finishing the persists of a job that died) moves
    ``latest`` only after the new manifest, and retention deletes only what ``latest``
    does not name, both under the directory's lock; this reader takes no lock. So a
    ``latest`` naming a tag that has no manifest when looked at was read just before a
    commit moved it and retention removed the old tag: ``latest`` is read again, and only
    a tag that lacks a manifest on two reads in a row is a problem. The listing taken at
    the start is not trusted for it: a commit landing while the checkpoints were checksummed
    made ``latest`` name a tag the listing lacked, reported as damage.
    """
    path = os.path.join(save_dir, LATEST_FILE)
    previous = None
    for _ in range(LATEST_READS):
        try:
            latest = read_latest(save_dir)
        except CheckpointError as err:
            results.append(("latest", [str(err)]))
            return
        if latest is None or latest in verified:
            return
        problems = _verify_pinned(save_dir, latest, checksums)
        if problems is not None:
            results.append((latest, problems))
            verified.add(latest)
            return
        if latest == previous:
            break
        previous = latest
    results.append(("latest", [f"{path} names {latest!r}, which is not a complete checkpoint"]))


def cmd_verify(args: argparse.Namespace) -> int:
    _check_dir(args.dir)
    _check_tag_dir(args.dir, args.tag)
    checksums = not args.no_checksums
    results: List[Tuple[str, List[str]]] = []
    if args.tag is not None:
        with reading(args.dir, args.tag):
            results.append((args.tag, verify_checkpoint(args.dir, args.tag, checksums)))
    else:
        scan = scan_checkpoints(args.dir)
        if not scan.complete and not scan.corrupt:
            raise UsageError(f"no complete checkpoint in {args.dir}")
        verified, gone = set(), []
        for _, tag in scan.complete:
            problems = _verify_pinned(args.dir, tag, checksums)
            if problems is None:
                gone.append(tag)
                continue
            results.append((tag, problems))
            verified.add(tag)
        for tag, err in scan.corrupt:
            results.append((tag, [err]))
        _verify_latest(args.dir, verified, checksums, results)
        if gone:
            print(f"not verified, removed by retention while verifying: {', '.join(gone)}")
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

ENTRY_POINT = "pretrain_gpt_moe.py"
"""The training script densify replays with: this project's own, beside ``deepspeed_ext/``
(never one a checkpoint names)."""

_ENTRY_POINT_NAMES = (ENTRY_POINT, "moc-pretrain")
"""What a frame marker's recorded command may start with (dropped, never run): this
project's entry point, as a script or as its console script."""

MAX_RECORDED_TOKENS = 4096
MAX_TOKEN_CHARS = 4096
"""Bounds of a frame marker's recorded command (and of each of its words)."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest ``--config`` YAML file densify reads from a recorded command."""

_DENSIFY_SETS = {"load": "--load", "save": "--save", "moc_shm_dir": "--moc-shm-dir",
                 "exit_interval": "--exit-interval"}
"""Flags (by destination) densify sets itself: removed from the recorded ones."""

_NOT_REPLAYED = ("moc_fault", "moc_fault_mtbf", "moc_fault_seed", "local_rank")
"""Recorded flags densify leaves out: fault injection (a fault would fire again in the
replay) and the launcher's rank."""

_REFUSED = {"deepspeed_config": "a DeepSpeed config reaches DeepSpeed unchecked and can make "
                                "it import the Python modules it names"}
"""Recorded flags (by destination) that name code or what loads code: never taken from a
checkpoint, only from the user (after ``--``)."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NUMBER = re.compile(r"^-\.?\d")


def _entry_point() -> str:
    """This project's ``pretrain_gpt_moe.py``: beside the ``deepspeed_ext`` package, in
    the repository or where pip installed both."""
    import deepspeed_ext
    root = os.path.dirname(os.path.dirname(os.path.abspath(deepspeed_ext.__file__)))
    path = os.path.join(root, ENTRY_POINT)
    if not os.path.isfile(path):
        raise UsageError(f"cannot find this project's {ENTRY_POINT} in {root} (beside "
                         f"deepspeed_ext/), which densify replays the frames with; "
                         f"reinstall MoC (pip install -e . in its repository)")
    return path


def _training_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import build_parser
    return build_parser()


def _long_options(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """The ``--flag`` names of the training parser (not --help), to their action."""
    return {opt: action for action in parser._actions
            if not isinstance(action, argparse._HelpAction)
            for opt in action.option_strings if opt.startswith("--")}


def _check_word(word: str, where: str) -> None:
    if _CONTROL.search(word):
        raise UsageError(f"{where}: {word!r} holds a control character")
    if len(word) > MAX_TOKEN_CHARS:
        raise UsageError(f"{where}: a word of {len(word)} characters (at most "
                         f"{MAX_TOKEN_CHARS})")


def _recorded(record: object, marker: str) -> Tuple[List[str], Optional[str]]:
    """The recorded command and working directory of a frame marker, type-checked.

    Raises:
        UsageError: naming ``marker``, when either is missing or malformed.
    """
    if not isinstance(record, dict):
        raise UsageError(f"{marker} is not a frame marker (a JSON object)")
    command, cwd = record.get("command"), record.get("cwd")
    if not command:
        raise UsageError(f"{marker} does not record the training command (frames written "
                         f"by {ENTRY_POINT} do)")
    if not isinstance(command, list) or not all(isinstance(w, str) for w in command):
        raise UsageError(f"{marker}: the recorded \"command\" is not a list of strings")
    if len(command) > MAX_RECORDED_TOKENS:
        raise UsageError(f"{marker}: the recorded \"command\" has {len(command)} words "
                         f"(at most {MAX_RECORDED_TOKENS})")
    for word in command:
        _check_word(word, f"{marker}: the recorded \"command\"")
    if cwd is not None:
        if not isinstance(cwd, str):
            raise UsageError(f"{marker}: the recorded \"cwd\" is not a string")
        _check_word(cwd, f"{marker}: the recorded \"cwd\"")
    return command, cwd


def _flag_groups(words: Sequence[str], options: Dict[str, argparse.Action],
                 where: str) -> List[Tuple[str, argparse.Action, List[str]]]:
    """``words`` (flags only) as (flag word, its action, its values), checked: every flag
    a ``--flag`` of the training parser, every value a plain string."""
    groups: List[Tuple[str, argparse.Action, List[str]]] = []
    for word in words:
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            action = options.get(name)
            if action is None:
                raise UsageError(f"{where}: unknown flag {name!r} ({ENTRY_POINT} has no "
                                 f"such flag)")
            groups.append((word, action, [value] if eq else []))
        elif not groups:
            raise UsageError(f"{where}: {word!r} where a flag should be")
        elif word.startswith("-") and not _NUMBER.match(word):
            raise UsageError(f"{where}: {groups[-1][1].option_strings[0]} has the value "
                             f"{word!r}, which is no plain value")
        else:
            groups[-1][2].append(word)
    for word, action, values in groups:
        if action.nargs == 0 and values:
            raise UsageError(f"{where}: {word.partition('=')[0]} takes no value, but has "
                             f"{values[0]!r}")
    return groups


def _stored_flags(command: List[str], marker: str) -> Tuple[List[str], List[str]]:
    """The training flags of a recorded command, to replay with this project's entry
    point: the leading script dropped, every ``--config`` file replaced by the flags it
    stands for (read and checked now, not by the replay), densify's own flags removed.

    Returns:
        (the flags, the names of recorded flags left out that the user should know of).

    Raises:
        UsageError: naming the flag and the file it came from, for anything that is not
            a known flag with plain values, a flag that names code, or a command that
            starts with something other than this project's entry point.
    """
    from megatron.training.arguments import yaml_to_argv
    from megatron.training.errors import ConfigError
    where = f"the command recorded in {marker}"
    first = next((i for i, w in enumerate(command) if w.startswith("--")), len(command))
    lead = command[:first]
    if not (lead == [] or (len(lead) == 1 and os.path.basename(lead[0]) in _ENTRY_POINT_NAMES)
            or lead == ["-m", ENTRY_POINT[:-len(".py")]]):
        raise UsageError(f"{where} starts with {' '.join(map(repr, lead))}, not this "
                         f"project's {ENTRY_POINT}")
    parser = _training_parser()
    options = _long_options(parser)
    from_files: List[str] = []
    flags: List[str] = []
    left_out: List[str] = []

    def keep(groups, source: str, out: List[str]) -> None:
        for word, action, values in groups:
            name = word.partition("=")[0]
            if action.dest in _REFUSED:
                raise UsageError(f"{source}: {name}: {_REFUSED[action.dest]}, so densify "
                                 f"does not take it from a checkpoint")
            if action.dest in _DENSIFY_SETS:
                continue
            if action.dest in _NOT_REPLAYED:
                left_out.append(name)
                continue
            out += [word, *values]

    groups = _flag_groups(command[first:], options, where)
    for word, action, values in groups:
        if action.dest != "config":
            continue
        if len(values) != 1:
            raise UsageError(f"{where}: --config takes one file, got {len(values)}")
        path = values[0]
        try:
            if not os.path.isfile(path):  # not a device or a pipe that never ends
                raise ConfigError("not a file")
            if os.path.getsize(path) > MAX_CONFIG_BYTES:
                raise ConfigError(f"larger than {MAX_CONFIG_BYTES} bytes")
            file_argv = yaml_to_argv(path, parser)
        except (ConfigError, OSError, UnicodeDecodeError, RecursionError) as err:
            hint = ("" if os.path.isabs(path) else
                    f" (a relative path, resolved from the current directory {os.getcwd()})")
            raise UsageError(f"--config {path}{hint}, recorded in {marker}: {err}") from None
        source = f"{path} (--config recorded in {marker})"
        for file_word in file_argv:
            _check_word(file_word, source)
        keep(_flag_groups(file_argv, options, source), source, from_files)
    keep([g for g in groups if g[1].dest != "config"], where, flags)
    # As pretrain_gpt_moe.py parses them: the files' flags first, the command's win.
    flags = from_files + flags
    if len(flags) > MAX_RECORDED_TOKENS:
        raise UsageError(f"{where}: {len(flags)} words with its --config files (at most "
                         f"{MAX_RECORDED_TOKENS})")
    return flags, sorted(set(left_out))


def _user_flags(words: List[str]) -> List[str]:
    """The training flags given after ``--`` (the user vouches for them), checked only
    for what densify sets itself."""
    if not words:
        raise UsageError("nothing after --: give the training flags there, or leave -- out "
                         "to replay with the flags the frames record")
    options = _long_options(_training_parser())
    for word in words:
        if "\x00" in word:
            raise UsageError(f"after --: {word!r} holds a NUL character")
        action = options.get(word.partition("=")[0]) if word.startswith("--") else None
        if action is not None and action.dest in _DENSIFY_SETS:
            raise UsageError(f"after --: densify sets {', '.join(_DENSIFY_SETS.values())} "
                             f"itself (--out is the replay's --save); leave "
                             f"{word.partition('=')[0]} out")
    return list(words)


def _count_files(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


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
            if isinstance(record, dict) and "world_size" in record:
                size = record["world_size"]
                where = os.path.join(exact.frame_dir(save_dir, frame), name)
                if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                    raise UsageError(f"{where}: world_size {size!r} is not a positive integer")
                if size > len(names):  # a window needs every rank's marker in each frame
                    most = max(_count_files(exact.frame_dir(save_dir, f))
                               for f in exact.list_frames(save_dir))
                    if size > most:
                        raise UsageError(f"{where}: world_size {size}, but no frame holds "
                                         f"more than {most} files: no window is complete")
                return size
    return None


def hostfile_slots(text: str, name: str) -> int:
    """Total slots of a DeepSpeed hostfile (``host slots=N`` lines; ``#`` comments).

    Raises:
        UsageError: a line that is not ``host slots=N`` with N >= 1, or no host.
    """
    total = 0
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or \
                not parts[1][len("slots="):].isdigit() or int(parts[1][len("slots="):]) < 1:
            raise UsageError(f"--hostfile {name} line {number}: expected 'HOST slots=N', "
                             f"got {line!r}")
        total += int(parts[1][len("slots="):])
    if not total:
        raise UsageError(f"--hostfile {name} names no host")
    return total


def replay_launcher(world_size: int, hostfile: Optional[str],
                    python_flags: List[str]) -> List[str]:
    """The command that starts densify's ``world_size`` replay ranks, before the script.

    Without ``hostfile``: torchrun on this host, refused when this host has CUDA but
    fewer GPUs than ranks (NCCL refuses two ranks on one device, so a 16-rank run's
    frames replayed on one 8-GPU host failed at the first collective). With it:
    DeepSpeed's launcher over its hosts, which must have exactly ``world_size`` slots
    and this project's directory at the same path.

    Raises:
        UsageError: naming ``--hostfile`` (unreadable, malformed, wrong slot count) or
            the GPU shortfall.
    """
    if hostfile is None:
        import torch
        if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
            raise UsageError(
                f"the frames were written by {world_size} ranks and this host has "
                f"{torch.cuda.device_count()} GPU(s): replay on the job's hosts with "
                f"--hostfile FILE (DeepSpeed's launcher, {world_size} slots in all)")
        return [sys.executable, *python_flags, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(world_size)]
    try:
        text = fs.read_text(hostfile, limit=1 << 20)
    except (OSError, ValueError, CheckpointError) as err:
        raise UsageError(f"--hostfile {hostfile}: cannot read it ({err})") from None
    slots = hostfile_slots(text, hostfile)
    if slots != world_size:
        raise UsageError(f"--hostfile {hostfile} has {slots} slots; the frames were written "
                         f"by {world_size} ranks, and the replay needs exactly that many")
    return ["deepspeed", "--hostfile", os.path.abspath(hostfile)]


def cmd_densify(args: argparse.Namespace) -> int:
    """Replay the newest complete window of exact-mode frames under ``args.dir`` on one
    machine, and leave the dense state at the window's end as a checkpoint in
    ``args.out``.

    The replay runs this project's own ``pretrain_gpt_moe.py`` with the training flags
    given after ``--``, or else with the flags the frames record, checked (see
    :func:`_stored_flags`): nothing a checkpoint records is run, or used as a working
    directory."""
    from deepspeed_ext import exact
    _check_dir(args.dir)
    world_size = _frames_world_size(args.dir)
    if world_size is None:
        raise UsageError(f"{os.path.join(args.dir, exact.EXACT_DIR)} holds no frames "
                         f"(was the run trained with --moc-mode exact?)")
    try:
        found = exact.find_window(args.dir, world_size)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise UsageError(f"{os.path.join(args.dir, exact.EXACT_DIR)}: malformed frame "
                         f"markers ({type(err).__name__}: {err})") from None
    if found is None:
        raise UsageError(f"{args.dir}: no window of frames is complete on storage")
    end = found.start + found.window
    latest = read_latest(args.dir)
    if latest is not None and latest.startswith("global_step") and \
            int(latest[len("global_step"):]) >= end:
        raise UsageError(f"{args.dir} already has checkpoint {latest}, at or after the "
                         f"frames' end (iteration {end}): nothing to densify")
    script = _entry_point()
    if args.train_args is not None:
        flags, source = _user_flags(args.train_args), "given after --"
    else:
        marker = os.path.join(exact.frame_dir(args.dir, found.start), "rank00000.json")
        try:
            command, cwd = _recorded(exact.read_marker(args.dir, found.start, 0), marker)
            flags, left_out = _stored_flags(command, marker)
        except UsageError as err:
            raise UsageError(f"{err}. densify runs nothing a checkpoint names and takes "
                             f"only known flags with plain values from it: give the "
                             f"training flags after -- instead (moc-ckpt densify DIR "
                             f"--out OUT -- FLAGS...), if you trust them") from None
        source = f"recorded in {marker}"
        if left_out:
            _stderr(f"note: leaving out the recorded {', '.join(left_out)} (the replay "
                    f"injects no faults, and the launcher numbers its own ranks)")
        if cwd is not None and os.path.realpath(cwd) != os.path.realpath(os.getcwd()):
            _stderr(f"note: the run's working directory was {cwd}; the replay runs in the "
                    f"current directory {os.getcwd()}, and relative paths in the recorded "
                    f"flags (--data-path, --config, ...) resolve from here. Run densify "
                    f"from the run's directory, or give the training flags yourself: "
                    f"moc-ckpt densify DIR --out OUT -- FLAGS...")
    if os.path.exists(args.out) and os.listdir(args.out):
        raise UsageError(f"--out {args.out} is not empty")
    # Memory of its own: with the run's --moc-shm-dir the replay would attach to that
    # job's keeper, prefer its memory frames over the storage window chosen here, and
    # delete that memory at its end while the job may still be restarting.
    shm = tempfile.mkdtemp(prefix="moc-densify-",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    # -P: the launcher does not import from the current directory (which may be the
    # checkpoint's); the workers import from the script's directory, this project's.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    launcher = replay_launcher(found.world_size, args.hostfile, safe_path)
    if args.hostfile is not None:
        # Other hosts create the directory themselves (the trainer makes its own
        # --moc-shm-dir private); this host's copy goes in the finally below.
        where = f"the {found.world_size} slots of {args.hostfile}"
    else:
        where = f"{found.world_size} local processes"
    cmd = [*launcher, script, *flags,
           "--load", os.path.abspath(args.dir), "--save", os.path.abspath(args.out),
           "--moc-shm-dir", shm, "--exit-interval", str(end)]
    print(f"replaying iterations {found.start + 1}..{end} of {args.dir} on "
          f"{where}, training flags {source}:\n"
          f"  {shlex.join(cmd)}", flush=True)
    try:
        if args.dry_run:
            return 0
        code = subprocess.call(cmd)  # in the current directory, never the recorded one
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
