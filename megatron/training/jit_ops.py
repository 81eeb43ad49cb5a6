"""DeepSpeed's just-in-time built C++ ops at start-up: which are built, where, and what
is done about a build lock that a killed process left behind.

The failure this prevents (issue 21, finding 10). ``torch.utils.cpp_extension`` lets one
process build an op and the others wait for it through a *lock file*
(``<extensions dir>/<op>/lock``, ``torch.utils.file_baton.FileBaton``): the builder
creates it and removes it when done, everyone else polls until it is gone, with no
timeout. A rank SIGKILLed while building leaves the file behind, and every later start
on that machine sleeps forever (PyTorch issue #189245). DeepSpeed 0.19.8's
``init_distributed`` JIT-built its CPU shared-memory op ``deepspeed_shm_comm`` in every
rank, before the rendezvous, although the op only serves
``deepspeed.comm.inference_all_reduce`` (DeepSpeed's inference tensor parallelism),
which training never calls; and its cache (``~/.cache/torch_extensions/py311_cpu``) was
shared by every virtual environment of the user, so two checkouts rebuilt it whenever
they alternated.

Every rank calls :func:`prepare_start` before ``deepspeed.init_distributed`` (no
collectives; the ranks of a node coordinate through one ``flock``). It

1. chooses the extensions directory: the user's ``TORCH_EXTENSIONS_DIR`` if set, else
   one of this environment and host (:func:`extensions_dir`), exported to this process
   (and the compilers it would start);
2. keeps the ops training does not use (:data:`UNUSED_OPS`) from being built or loaded:
   DeepSpeed 0.19.8 has no documented switch for that, so they are marked incompatible
   in its table of compatible ops, the only thing its ``build_shm_op`` consults before
   building. Training needs no JIT op at all (:data:`REQUIRED_OPS` is empty: its
   optimizer is ``torch.optim.AdamW``, its collectives ``torch.distributed``'s), so there
   is nothing to build ahead;
3. looks for build locks under the directory while holding the node's start-up lock
   (``<dir>/.moc-startup.lock``) exclusively: every MoC process of the directory holds
   that ``flock`` shared from its start to its exit, and the OS drops it when the
   process dies, however it dies; so whoever gets it exclusively knows that no MoC
   process of this directory is starting, running or building, and that any build
   lock there is a dead one. In a directory chosen here such a lock is removed; in the
   user's own directory (other programs may build there) it is reported with the file
   to remove. A rank that cannot get the lock exclusively (another rank of the node
   holds it shared) cannot tell a live build from a dead one: it reports any lock it
   sees and goes on.
"""

import fcntl
import hashlib
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Tuple

logger = logging.getLogger(__name__)

UNUSED_OPS: Tuple[str, ...] = ("deepspeed_shm_comm",)
"""DeepSpeed ops built at ``init_distributed`` that training never uses: the CPU
shared-memory all-reduce behind ``inference_all_reduce`` only (DeepSpeed 0.19.8,
``deepspeed/comm/torch.py``: ``build_shm_op``)."""

REQUIRED_OPS: Tuple[str, ...] = ()
"""JIT ops a training run needs: none (AdamW from torch, collectives from
``torch.distributed``, no offload, no ZeRO-3 quantizer)."""

STARTUP_LOCK = ".moc-startup.lock"
"""The node's start-up ``flock`` file inside the extensions directory."""

BUILD_LOCK = "lock"
"""The file name of PyTorch's build lock inside an op's build directory."""

_held = []
"""This process's open start-up lock file: held (shared) until the process exits."""


@dataclass(frozen=True)
class ExtensionsDir:
    """Where ``torch.utils.cpp_extension`` builds and finds this run's JIT ops."""

    path: str
    """The directory that holds one build directory per op."""
    ours: bool
    """Chosen by :func:`extensions_dir` (True) or the user's ``TORCH_EXTENSIONS_DIR``."""


@dataclass
class LockCheck:
    """What :func:`check_build_locks` found and did."""

    removed: List[str] = field(default_factory=list)
    """Dead builds' lock files removed."""
    reported: List[str] = field(default_factory=list)
    """Lock files left in place and reported (the user's directory, or not verifiable)."""
    verified: bool = False
    """This process held the start-up lock exclusively: no MoC build was running."""


def build_folder() -> str:
    """``py<major><minor><abiflags>_<accelerator>``, as PyTorch names its own per-build
    subdirectory of the default cache (a CUDA and a CPU build of torch must not share)."""
    import torch
    if torch.version.hip is not None:
        accel = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accel = "cu" + torch.version.cuda.replace(".", "")
    else:
        accel = "cpu"
    return f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}"


def extensions_dir(environ: Mapping[str, str], default_root: str, prefix: str, host: str,
                   folder: str) -> ExtensionsDir:
    """The extensions directory of a run; pure.

    Args:
        environ: the process environment (``TORCH_EXTENSIONS_DIR`` wins when set).
        default_root: PyTorch's default cache root (``~/.cache/torch_extensions``).
        prefix: ``sys.prefix``, the environment (virtualenv) the run uses.
        host: this machine's name: one directory per node, so that an ``flock`` never
            has to work across machines of a shared home directory.
        folder: :func:`build_folder`.
    """
    user = environ.get("TORCH_EXTENSIONS_DIR")
    if user:
        return ExtensionsDir(path=user, ours=False)
    env = hashlib.sha256(os.path.realpath(prefix).encode()).hexdigest()[:12]
    return ExtensionsDir(path=os.path.join(default_root, f"moc-{host}-{env}", folder), ours=True)


def disable_unused_ops() -> None:
    """Mark :data:`UNUSED_OPS` incompatible in DeepSpeed's table of compatible ops
    (``deepspeed.ops.__compatible_ops__``, computed once per process on first access and
    then kept), so ``init_distributed`` neither builds nor loads them. Every rank, before
    ``deepspeed.init_distributed``."""
    import deepspeed.ops
    table = deepspeed.ops.__compatible_ops__
    for name in UNUSED_OPS:
        table[name] = False


def build_locks(root: str) -> List[str]:
    """Every PyTorch build lock file directly under an op's directory in ``root``."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, n, BUILD_LOCK) for n in names
            if os.path.isfile(os.path.join(root, n, BUILD_LOCK))]


def check_build_locks(ext: ExtensionsDir) -> LockCheck:
    """Take the node's start-up lock, deal with dead builds' locks, keep the start-up
    lock shared until this process exits (see the module doc). Every rank, once, before
    anything that could build an op; no collectives.

    Returns:
        What was removed and what was reported.
    """
    os.makedirs(ext.path, exist_ok=True)
    fd = os.open(os.path.join(ext.path, STARTUP_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    check = LockCheck()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        check.verified = True
    except BlockingIOError:
        # Another rank of the node holds it. Shared: waits only while a rank checks
        # (milliseconds; a checker that dies releases it).
        fcntl.flock(fd, fcntl.LOCK_SH)
    for path in build_locks(ext.path):
        if check.verified and ext.ours:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            check.removed.append(path)
        else:
            check.reported.append(path)
    if check.verified:
        fcntl.flock(fd, fcntl.LOCK_SH)  # no build runs now: another checker may not remove
    _held.append(fd)
    return check


def release_startup_lock() -> None:
    """Close the start-up lock files :func:`check_build_locks` left held in this process.

    A rank never calls it (its lock is held until it exits). Called by tests, which run
    :func:`check_build_locks` in a process that lives on, after each check.
    """
    while _held:
        os.close(_held.pop())


def prepare_start(log: Optional[logging.Logger] = None) -> ExtensionsDir:
    """Every rank, before ``deepspeed.init_distributed``: the extensions directory, no
    unused op, no dead build's lock (see the module doc).

    Returns:
        The extensions directory this process builds in (exported as
        ``TORCH_EXTENSIONS_DIR``).
    """
    from torch.utils.cpp_extension import get_default_build_root
    log = log or logger
    ext = extensions_dir(os.environ, get_default_build_root(), sys.prefix,
                         socket.gethostname(), build_folder())
    os.environ["TORCH_EXTENSIONS_DIR"] = ext.path
    disable_unused_ops()
    try:
        check = check_build_locks(ext)
    except OSError as e:  # an unwritable cache: nothing is built, so start anyway
        log.warning("cannot check %s for dead JIT build locks (%s)", ext.path, e)
        return ext
    for path in check.removed:
        log.warning("removed %s: the lock of a JIT build whose process died (no build of "
                    "this environment was running on this node)", path)
    for path in check.reported:
        why = ("TORCH_EXTENSIONS_DIR is yours and other programs may be building there"
               if not ext.ours else "another rank of this node is starting")
        log.warning("a JIT build lock %s exists (%s); if no build is running, remove it "
                    "(rm %s), or a start that needs this op waits forever", path, why, path)
    return ext


def lock_hint() -> str:
    """For a start-up hang report: the build locks present in the extensions directory
    (a start that waits on one of them waits forever), or ``""``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    locks = build_locks(root) if root else []
    if not locks:
        return ""
    return ("JIT build lock(s) present: " + ", ".join(locks)
            + " (if no build is running, remove them)")
