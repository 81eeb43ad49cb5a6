"""A one-rank gloo world for DeepSpeed inside the test process (its MoE layer needs
process groups), torn down afterwards: the process group, DeepSpeed's cached groups and
the launcher variables it needed are gone again. A module fixture that left them made
later tests in the same worker fail: an in-process ``init_process_group`` ("trying to
initialize the default process group twice"), and a supervisor started with the leaked
``MASTER_PORT`` (its store's port still held)."""

import contextlib
import os
import socket

import torch.distributed as dist


@contextlib.contextmanager
def deepspeed_world_of_one():
    """Rank 0 of 1 through ``deepspeed.init_distributed`` (as the trainer starts it), or
    the world that exists already (then left as it is)."""
    if dist.is_initialized():
        yield
        return
    import deepspeed
    from megatron.training import jit_ops
    from megatron.training.process import close_process_groups
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        jit_ops.disable_unused_ops()  # as the trainer: no JIT build in the test process
        deepspeed.init_distributed(dist_backend="gloo")
        yield
    finally:
        close_process_groups()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
