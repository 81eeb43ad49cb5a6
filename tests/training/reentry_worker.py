"""A rank that trains the same short job twice in one process (the re-entrant run an
in-job restart stands on).

``python reentry_worker.py OUT ROUNDS -- TRAINING ARGS``: rank 0 keeps the job's
TCPStore on MASTER_PORT for the whole process, as a launcher's agent does; every rank
then, ``ROUNDS`` times: ``pretrain`` with the arguments (``{round}`` in them replaced by
the round's number), ``remove_deepspeed_shm_buffers``, ``close_process_groups``. Each
round forms its process group on the store under its own prefix
(``TORCHELASTIC_RESTART_COUNT``). Writes ``<OUT>/rank<R>.json``: per round, the losses,
the threads left running after the close, and what was left of the groups and
parameters.
"""

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.training import (close_process_groups, pretrain,  # noqa: E402
                                        remove_deepspeed_shm_buffers)


def _left_over() -> dict:
    """What of the run's process groups is still referenced after the close, and how many
    of its parameters (each naming its groups, whose connections stay open while it
    lives) are left once the run's objects are freed."""
    import gc

    import torch
    from deepspeed.utils import groups
    from megatron.training.in_job import free_run_objects
    free_run_objects()
    return {"initialized": dist.is_initialized(),
            "deepspeed_expert_groups": len(groups._get_expert_parallel_group_dict()),
            "parameters": sum(isinstance(o, torch.nn.Parameter) for o in gc.get_objects())}


def main() -> None:
    out, rounds = sys.argv[1], int(sys.argv[2])
    argv = sys.argv[sys.argv.index("--") + 1:]
    rank = int(os.environ["RANK"])
    store = None
    if rank == 0:  # outlives every round's process group, as torchrun's agent store does
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              int(os.environ["WORLD_SIZE"]), is_master=True,
                              wait_for_workers=False)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    before = {t.name for t in threading.enumerate()}
    report = []
    for n in range(rounds):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(n)
        result = pretrain(parse_args([a.replace("{round}", str(n)) for a in argv]))
        remove_deepspeed_shm_buffers()
        close_process_groups()
        report.append({"losses": result.losses, "iteration": result.iteration,
                       "threads": sorted({t.name for t in threading.enumerate()} - before),
                       **_left_over()})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    del store


if __name__ == "__main__":
    main()
