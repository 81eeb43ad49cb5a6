"""Shared memory of the tests that run MoC's keepers: a fresh directory per test, and its
cleanup."""

import os
import shutil
import signal
import uuid


def new_shm_dir() -> str:
    """A ``--moc-shm-dir`` no other test uses."""
    return f"/dev/shm/moc-test-{uuid.uuid4().hex[:10]}"


def stop_keepers(shm: str) -> None:
    """Stop the keepers a test left under ``shm`` and remove it. A job that failed or was
    killed leaves its keeper waiting for a restart, up to its 10-minute idle timeout;
    deleting the directory alone leaves that process running after the suite. A keeper
    that does not finish its queue in time (a test hung it in a persist) is killed."""
    from deepspeed_ext.keeper import KeeperError, request, shutdown_keeper
    if os.path.isdir(shm):
        for node in os.listdir(shm):
            directory = os.path.join(shm, node)
            if not shutdown_keeper(directory, 15):
                try:
                    os.kill(request(directory, {"op": "ping"}, timeout_s=5)["pid"], signal.SIGKILL)
                except (KeeperError, OSError):
                    pass  # none was running
    shutil.rmtree(shm, ignore_errors=True)

