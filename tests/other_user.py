"""A second local user for the shared-node tests: code run as ``nobody`` in a child process.

The attacks these tests replay need another user of the same machine. When the suite
runs as root, :func:`run_as_other_user` runs a snippet of Python as ``nobody`` (a plain
interpreter, ``-I``: it imports nothing of this repository); otherwise the tests that need
it are skipped, with the reason.
"""

import functools
import os
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest


def other_user():
    """``(uid, gid)`` of the user the attacks run as; skips the test when this process
    cannot switch to it (not root, or no ``nobody``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a second local user's part as 'nobody'")
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user to play the second local user")
    return entry.pw_uid, entry.pw_gid


def _dropper(uid: int, gid: int):
    def drop():
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    return drop


@functools.lru_cache(maxsize=None)
def _interpreter(uid: int, gid: int):
    """A Python the other user may run (this one may live under root's home)."""
    for candidate in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if not candidate:
            continue
        try:
            subprocess.run([candidate, "-I", "-c", "pass"], preexec_fn=_dropper(uid, gid),
                           check=True, capture_output=True, timeout=30, cwd="/")
            return candidate
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def run_as_other_user(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` (Python source; ``sys.argv[1:]`` are ``args``) as the other user;
    returns the finished process (stdout and stderr captured as text)."""
    uid, gid = other_user()
    python = _interpreter(uid, gid)
    if python is None:
        pytest.skip("no Python interpreter that 'nobody' may run")
    return subprocess.run([python, "-I", "-c", code, *args], preexec_fn=_dropper(uid, gid),
                          capture_output=True, text=True, timeout=timeout, cwd="/")


def start_as_other_user(argv) -> subprocess.Popen:
    """Start ``argv`` (a program anyone may run, e.g. ``sleep``) as the other user."""
    uid, gid = other_user()
    return subprocess.Popen(argv, preexec_fn=_dropper(uid, gid), cwd="/")


def shared_tmp() -> str:
    """A new world-writable, sticky directory (like ``/dev/shm``) both users can use."""
    path = tempfile.mkdtemp(prefix="moc-shared-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                            else None)
    os.chmod(path, 0o1777)
    return path
