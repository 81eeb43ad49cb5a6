"""Shared memory of the tests that run MoC's keepers: a fresh directory per test, and its
cleanup."""

import os
import shutil
import uuid


def new_shm_dir() -> str:
    """A ``--moc-shm-dir`` no other test uses."""
    return f"/dev/shm/moc-test-{uuid.uuid4().hex[:10]}"


def stop_keepers(shm: str) -> None:
    """Stop the keepers a test left under ``shm`` and remove it. A job that failed or was
    killed leaves its keeper waiting for a restart, up to its 10-minute idle timeout;
    deleting the directory alone leaves that process running after the suite."""
    from deepspeed_ext.keeper import shutdown_keeper
    if os.path.isdir(shm):
        for node in os.listdir(shm):
            shutdown_keeper(os.path.join(shm, node), 30)
    shutil.rmtree(shm, ignore_errors=True)
