"""Shared memory as a private home: created 0700, refused when another user could reach it."""

import os
import shutil
import stat

import pytest

from deepspeed_ext import keeper
from deepspeed_ext.private_dir import (UnsafeDirectoryError, check_private_dir,
                                       make_private_dir, open_private, open_private_file)
from tests.other_user import other_user, run_as_other_user, shared_tmp


def test_directories_are_created_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        node = make_private_dir(str(tmp_path / "shm" / "node0"), root=str(tmp_path / "shm"))
    finally:
        os.umask(old)
    for path in (tmp_path / "shm", tmp_path / "shm" / "node0"):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    assert make_private_dir(node, root=str(tmp_path / "shm")) == node  # a second rank: checked


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o777, 0o701])
def test_an_existing_directory_others_can_reach_is_refused(tmp_path, mode):
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, mode)
    with pytest.raises(UnsafeDirectoryError, match="--moc-shm-dir"):
        make_private_dir(str(shm / "node0"), root=str(shm))
    assert not (shm / "node0").exists()  # nothing was created inside it


def test_a_link_is_refused_and_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "shm").symlink_to(target)
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        make_private_dir(str(tmp_path / "shm"))
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        check_private_dir(str(tmp_path / "shm"), flag="--moc-shm-dir")


def test_a_world_writable_ancestor_without_sticky_bit_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # another user could rename our directory away
    with pytest.raises(UnsafeDirectoryError, match="not sticky"):
        make_private_dir(str(open_dir / "shm"))
    os.chmod(open_dir, 0o1777)  # /dev/shm, /tmp: fine
    make_private_dir(str(open_dir / "shm"))


def test_files_are_created_0600_and_never_through_a_link(tmp_path):
    home = make_private_dir(str(tmp_path / "home"))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, os.path.join(home, "keeper.log"))
    with pytest.raises(OSError):
        open_private_file(os.path.join(home, "keeper.log"), "a")
    assert victim.read_text() == "precious"
    fd = open_private(os.path.join(home, "slot0.img"), os.O_RDWR | os.O_CREAT)
    os.close(fd)
    assert stat.S_IMODE(os.lstat(os.path.join(home, "slot0.img")).st_mode) == 0o600


def test_a_directory_another_user_created_first_is_refused_and_left_alone():
    """The attack of the issue: another local user pre-creates the job's predictable
    shared-memory directory, world-writable, with a link at ``keeper.log`` to a file of
    the job's user. The job must refuse it before writing anything there."""
    other_user()
    shared = shared_tmp()
    try:
        shm = os.path.join(shared, "moc-0-0123456789ab")
        victim = os.path.join(shared, "victim")
        with open(victim, "w") as f:
            f.write("precious")
        planted = run_as_other_user(
            "import os, sys; shm, victim = sys.argv[1:]; node = os.path.join(shm, 'node0');"
            "os.makedirs(node); os.chmod(shm, 0o777); os.chmod(node, 0o777);"
            "os.symlink(victim, os.path.join(node, 'keeper.log'))", shm, victim)
        assert planted.returncode == 0, planted.stderr
        with pytest.raises(UnsafeDirectoryError, match="--moc-shm-dir") as refused:
            keeper.ensure_keeper(os.path.join(shm, "node0"), start_timeout_s=5)
        assert "belongs to uid" in str(refused.value)
        with open(victim) as f:
            assert f.read() == "precious"
        assert sorted(os.listdir(os.path.join(shm, "node0"))) == ["keeper.log"]  # nothing added
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_another_user_cannot_read_or_plant_in_a_job_directory(tmp_path):
    """With the job's directory private, the other user can neither list nor write it."""
    other_user()
    shared = shared_tmp()
    try:
        node = make_private_dir(os.path.join(shared, "shm", "node0"),
                                root=os.path.join(shared, "shm"))
        with open(os.path.join(node, "slot0.img"), "wb") as f:
            f.write(b"weights")
        tried = run_as_other_user(
            "import os, sys; node = sys.argv[1]\n"
            "for attempt in (lambda: os.listdir(node),\n"
            "                lambda: open(os.path.join(node, 'slot0.img'), 'rb').read(),\n"
            "                lambda: open(os.path.join(node, 'slot1.json'), 'w')):\n"
            "    try:\n"
            "        attempt(); print('allowed')\n"
            "    except PermissionError:\n"
            "        print('denied')\n", node)
        assert tried.stdout.split() == ["denied"] * 3, tried.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)
