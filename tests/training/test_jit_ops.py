"""DeepSpeed's JIT ops at start-up (megatron/training/jit_ops.py): the per-environment
extensions directory and what is done about a dead build's lock file."""

import fcntl
import os
import subprocess
import sys

from megatron.training import jit_ops
from megatron.training.jit_ops import ExtensionsDir, check_build_locks, extensions_dir

ROOT = "/home/u/.cache/torch_extensions"


def test_each_environment_and_host_gets_its_own_directory_unless_the_user_chose_one():
    """Two virtual environments of one user no longer share (and rebuild) one cache; the
    user's TORCH_EXTENSIONS_DIR is kept as it is."""
    a = extensions_dir({}, ROOT, "/work/a/.venv", "node1", "py311_cpu")
    b = extensions_dir({}, ROOT, "/work/b/.venv", "node1", "py311_cpu")
    assert a.ours and b.ours and a.path != b.path
    assert a == extensions_dir({}, ROOT, "/work/a/.venv", "node1", "py311_cpu")
    assert a.path.startswith(ROOT + "/") and a.path.endswith("/py311_cpu")
    assert a.path != extensions_dir({}, ROOT, "/work/a/.venv", "node2", "py311_cpu").path
    assert a.path != extensions_dir({}, ROOT, "/work/a/.venv", "node1", "py311_cu128").path
    user = extensions_dir({"TORCH_EXTENSIONS_DIR": "/scratch/ext"}, ROOT, "/work/a/.venv",
                          "node1", "py311_cpu")
    assert user == ExtensionsDir(path="/scratch/ext", ours=False)


def _dead_build(root, op="deepspeed_shm_comm"):
    """What a rank SIGKILLed in the middle of a JIT build leaves: the op's build
    directory with PyTorch's lock file in it."""
    os.makedirs(os.path.join(root, op), exist_ok=True)
    path = os.path.join(root, op, jit_ops.BUILD_LOCK)
    open(path, "w").close()
    return path


def _release_held():
    jit_ops.release_startup_lock()  # the test process is not a rank that lives on


def test_a_dead_builds_lock_in_our_directory_is_removed(tmp_path):
    lock = _dead_build(str(tmp_path))
    try:
        check = check_build_locks(ExtensionsDir(str(tmp_path), ours=True))
    finally:
        _release_held()
    assert check.verified and check.removed == [lock] and check.reported == []
    assert not os.path.exists(lock)


def test_a_lock_in_the_users_directory_is_reported_not_removed(tmp_path):
    """Other programs may build in the user's own TORCH_EXTENSIONS_DIR: the file to
    remove is named, nothing is deleted."""
    lock = _dead_build(str(tmp_path))
    try:
        check = check_build_locks(ExtensionsDir(str(tmp_path), ours=False))
    finally:
        _release_held()
    assert check.reported == [lock] and check.removed == [] and os.path.exists(lock)


def test_a_lock_is_left_alone_while_another_process_of_the_node_is_starting(tmp_path):
    """A rank still starting (it holds the start-up lock shared) might be building: its
    lock file is reported, not taken for a dead one."""
    lock = _dead_build(str(tmp_path))
    startup = os.path.join(str(tmp_path), jit_ops.STARTUP_LOCK)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()",
         startup], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        try:
            check = check_build_locks(ExtensionsDir(str(tmp_path), ours=True))
        finally:
            _release_held()
    finally:
        holder.kill()
        holder.wait()
    assert not check.verified and check.reported == [lock] and os.path.exists(lock)
    # Once that process is gone (killed, as a failed rank would be) the lock is dead.
    try:
        again = check_build_locks(ExtensionsDir(str(tmp_path), ours=True))
    finally:
        _release_held()
    assert again.verified and again.removed == [lock]


def test_the_start_up_lock_stays_held_shared_after_the_check(tmp_path):
    """A later checker must not take this process's possible builds for dead ones."""
    ext = ExtensionsDir(str(tmp_path), ours=True)
    try:
        check_build_locks(ext)
        fd = os.open(os.path.join(str(tmp_path), jit_ops.STARTUP_LOCK), os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got_exclusive = True
            except BlockingIOError:
                got_exclusive = False
        finally:
            os.close(fd)
    finally:
        _release_held()
    assert not got_exclusive


def test_lock_hint_names_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert jit_ops.lock_hint() == ""
    lock = _dead_build(str(tmp_path), "fused_adam")
    assert lock in jit_ops.lock_hint()
