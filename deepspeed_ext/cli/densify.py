"""``moc-ckpt densify``: replay the newest complete window of exact-mode frames with this
project's ``pretrain_gpt_moe.py`` into a checkpoint at the window's end."""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional, Tuple

from deepspeed_ext.cli.common import UsageError, check_dir, stderr
from deepspeed_ext.cli.entry_point import ENTRY_POINT, find_entry_point
from deepspeed_ext.cli.replay_flags import (ReplayCheckUnavailable,
                                            recorded_command, stored_flags, user_flags)
from deepspeed_ext.format import fs
from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.store.latest import read_latest


def entry_point() -> str:
    """This project's ``pretrain_gpt_moe.py`` (:func:`cmd_densify` replays with it).

    Raises:
        UsageError: it is not there.
    """
    return find_entry_point(ENTRY_POINT, "densify replays the frames with", UsageError)


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
    given after ``--``, or else with the flags the frames record, checked by that script
    (see :func:`~deepspeed_ext.cli.replay_flags.stored_flags`): nothing a checkpoint
    records is run, or used as a working directory. Run by
    :func:`deepspeed_ext.cli.main.main`."""
    check_dir(args.dir)
    found, end = _newest_window(args.dir)
    script = entry_point()
    flags, source = _replay_flags(args, found.start, script)
    if os.path.exists(args.out) and os.listdir(args.out):
        raise UsageError(f"--out {args.out} is not empty")
    return _replay(args, found.world_size, found.start, end, [script, *flags], source)


def _newest_window(save_dir: str):
    """(the newest complete window of frames under ``save_dir``, the iteration it ends
    at).

    Raises:
        UsageError: no frames, malformed markers, no complete window, or a checkpoint
            at or after the window's end already.
    """
    from deepspeed_ext import exact
    world_size = _frames_world_size(save_dir)
    if world_size is None:
        raise UsageError(f"{os.path.join(save_dir, exact.EXACT_DIR)} holds no frames "
                         f"(was the run trained with --moc-mode exact?)")
    try:
        found = exact.find_window(save_dir, world_size)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise UsageError(f"{os.path.join(save_dir, exact.EXACT_DIR)}: malformed frame "
                         f"markers ({type(err).__name__}: {err})") from None
    if found is None:
        raise UsageError(f"{save_dir}: no window of frames is complete on storage")
    end = found.start + found.window
    latest = read_latest(save_dir)
    if latest is not None and latest.startswith("global_step") and \
            int(latest[len("global_step"):]) >= end:
        raise UsageError(f"{save_dir} already has checkpoint {latest}, at or after the "
                         f"frames' end (iteration {end}): nothing to densify")
    return found, end


def _replay_flags(args: argparse.Namespace, start: int,
                  script: str) -> Tuple[List[str], str]:
    """(the training flags to replay with, where they came from): those after ``--``, or
    else those the window's first frame marker of rank 0 records, checked by ``script``
    (this project's entry point); notes on stderr of what is left out and of a working
    directory that differs."""
    from deepspeed_ext import exact
    if args.train_args is not None:
        return user_flags(args.train_args, script), "given after --"
    marker = os.path.join(exact.frame_dir(args.dir, start), "rank00000.json")
    try:
        command, cwd = recorded_command(exact.read_marker(args.dir, start, 0), marker)
        flags, left_out = stored_flags(command, marker, script)
    except ReplayCheckUnavailable:
        raise  # the entry point failed: other flags would not help
    except UsageError as err:
        raise UsageError(f"{err}. densify runs nothing a checkpoint names and takes "
                         f"only known flags with plain values from it: give the "
                         f"training flags after -- instead (moc-ckpt densify DIR "
                         f"--out OUT -- FLAGS...), if you trust them") from None
    if left_out:
        stderr(f"note: leaving out the recorded {', '.join(left_out)} (the replay "
               f"injects no faults, and the launcher numbers its own ranks)")
    if cwd is not None and os.path.realpath(cwd) != os.path.realpath(os.getcwd()):
        stderr(f"note: the run's working directory was {cwd}; the replay runs in the "
               f"current directory {os.getcwd()}, and relative paths in the recorded "
               f"flags (--data-path, --config, ...) resolve from here. Run densify "
               f"from the run's directory, or give the training flags yourself: "
               f"moc-ckpt densify DIR --out OUT -- FLAGS...")
    return flags, f"recorded in {marker}"


def _replay(args: argparse.Namespace, world_size: int, start: int, end: int,
            script_and_flags: List[str], source: str) -> int:
    """Run the replay of iterations ``start + 1 .. end`` (print it only, with
    ``--dry-run``) and check that it left checkpoint ``global_step{end}`` in ``--out``."""
    # -P: the launcher does not import from the current directory (which may be the
    # checkpoint's); the workers import from the script's directory, this project's.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    launcher = replay_launcher(world_size, args.hostfile, safe_path)
    # Memory of its own: with the run's --moc-shm-dir the replay would attach to that
    # job's keeper, prefer its memory frames over the storage window chosen here, and
    # delete that memory at its end while the job may still be restarting. Made after the
    # launcher's checks: a refused --hostfile or GPU count left it behind in /dev/shm.
    shm = tempfile.mkdtemp(prefix="moc-densify-",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    if args.hostfile is not None:
        # Other hosts create the directory themselves (the trainer makes its own
        # --moc-shm-dir private); this host's copy goes in the finally below.
        where = f"the {world_size} slots of {args.hostfile}"
    else:
        where = f"{world_size} local processes"
    cmd = [*launcher, *script_and_flags,
           "--load", os.path.abspath(args.dir), "--save", os.path.abspath(args.out),
           "--moc-shm-dir", shm, "--exit-interval", str(end)]
    print(f"replaying iterations {start + 1}..{end} of {args.dir} on "
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
        stderr(f"error: the replay exited with status {code}; no checkpoint {tag} in {args.out}")
        return 1
    print(f"wrote {os.path.join(args.out, tag)}: the exact state at iteration {end}")
    return 0
