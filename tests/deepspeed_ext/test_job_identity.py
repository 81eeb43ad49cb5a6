"""Job identity: a run id kept in the save directory binds a node's shared memory to one job."""

import os

import pytest

from deepspeed_ext import keeper
from deepspeed_ext.job_identity import (NODE_RECORD, RUN_ID_FILE, ForeignJobError,
                                        bind_node_dir, read_or_create_run_id,
                                        run_id_for_memory_only)
from deepspeed_ext.private_dir import make_private_dir
from tests.shm import new_shm_dir, stop_keepers


def test_the_run_id_is_created_once_and_kept(tmp_path):
    save = str(tmp_path / "ckpt")
    first = read_or_create_run_id(save)
    assert len(first) == 32 and read_or_create_run_id(save) == first
    with open(os.path.join(save, RUN_ID_FILE), "w") as f:
        f.write("../../not an id")
    said = []
    second = read_or_create_run_id(save, log=said.append)
    assert second != first and "does not hold a run id" in said[0]
    assert read_or_create_run_id(save) == second


def test_a_run_id_file_that_never_ends_is_not_read_forever(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    os.symlink("/dev/zero", save / RUN_ID_FILE)  # not a regular file: replaced, not read
    assert len(read_or_create_run_id(str(save))) == 32


def test_a_node_directory_serves_one_job(tmp_path):
    node = make_private_dir(str(tmp_path / "shm" / "node0"), root=str(tmp_path / "shm"))
    assert bind_node_dir(node, "a" * 32)
    assert not bind_node_dir(node, "a" * 32)  # a restart of the same job
    with pytest.raises(ForeignJobError, match="--moc-shm-dir"):
        bind_node_dir(node, "b" * 32)
    with open(os.path.join(node, NODE_RECORD), "w") as f:
        f.write("[[[[")  # damaged: nobody's, so nobody takes it over silently
    with pytest.raises(ForeignJobError):
        bind_node_dir(node, "a" * 32)


def test_memory_only_jobs_are_named_by_their_directory(tmp_path):
    assert run_id_for_memory_only(str(tmp_path / "a")) != run_id_for_memory_only(str(tmp_path / "b"))
    assert run_id_for_memory_only(str(tmp_path / "a")) == run_id_for_memory_only(str(tmp_path / "a"))


def test_two_jobs_sharing_a_shm_dir_neither_attach_nor_delete_each_other(tmp_path):
    """Job A's keeper runs; job B, given the same --moc-shm-dir, is refused (it would have
    recovered A's snapshots and A's exit deleted B's memory), cannot make A's keeper
    take its requests, and cannot have A's memory deleted."""
    shm = new_shm_dir()
    node = os.path.join(shm, "node0")
    run_a, run_b = "a" * 32, "b" * 32
    try:
        keeper.ensure_keeper(node, idle_timeout_s=60, start_timeout_s=60, run_id=run_a,
                             save_dir=str(tmp_path / "a"))
        with pytest.raises(ForeignJobError, match="another job"):
            keeper.ensure_keeper(node, idle_timeout_s=60, run_id=run_b)
        with pytest.raises(keeper.KeeperError, match="serves run"):
            keeper.request(node, {"op": "hello", "pid": os.getpid(), "run_id": run_b})
        assert not keeper.shutdown_keeper(node, 10, run_id=run_b)
        assert os.path.isdir(node) and keeper.alive(node)  # A's memory and keeper live on
        assert keeper.shutdown_keeper(node, 30, run_id=run_a)
        assert not os.path.exists(node)
    finally:
        stop_keepers(shm)
