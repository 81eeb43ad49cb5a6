"""A one-rank gloo world in the test's own process (no process started): the
collectives of :mod:`deepspeed_ext.runtime` run for real, each over one rank."""

import contextlib

import torch.distributed as dist

from deepspeed_ext.runtime import groups


@contextlib.contextmanager
def world_of_one(tmp_path, timeout=None):
    """``init_process_group`` on gloo with rank 0 of 1 (a file store in ``tmp_path``) and
    ``timeout`` (None: torch's default); destroyed, and the metadata group forgotten,
    afterwards."""
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()
        groups.forget_metadata_group()
