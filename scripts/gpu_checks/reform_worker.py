"""``in_job_restart``'s worker: the process-group part of an in-job recovery, repeated in
one process, as a survivor does it (one rank: NCCL takes one rank per GPU).

    python scripts/gpu_checks/reform_worker.py ROUNDS OUT_JSON

Each round: the default group on a store under the round's prefix (as the trainer makes
it under MoC's supervisor), DeepSpeed's world and expert groups, MoC's metadata group,
one all-reduce on the device; then what a survivor does after a failed run:
``abort_communicators`` (NCCL: ``ncclCommAbort`` on every group; gloo: nothing) and
``close_process_groups``. Writes every round's phase times to OUT_JSON; exit 1 when a
collective gave a wrong sum.
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def one_round(store, number: int, device: torch.device) -> dict:
    """Form round ``number``'s groups, check one all-reduce, leave as after a failure."""
    import deepspeed
    from deepspeed.utils import groups
    from deepspeed_ext.runtime import rounds
    from deepspeed_ext.runtime.groups import init_metadata_group
    from megatron.training.process import abort_communicators, close_process_groups
    timeout = timedelta(seconds=60)
    times = {"round": number}
    t0 = time.perf_counter()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.PrefixStore(rounds.group_prefix(number), store),
                            rank=0, world_size=1, timeout=timeout, **kwargs)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    init_metadata_group(timeout)
    groups._create_expert_and_data_parallel(1)
    times["groups_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    value = torch.full((1024,), float(number + 1), device=device)
    dist.all_reduce(value, group=groups._get_expert_parallel_group("ep_size_1"))
    dist.all_reduce(value)
    times["sum_ok"] = bool(torch.all(value == float(number + 1)).item())
    times["collectives_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    times["aborted"] = abort_communicators()
    times["abort_s"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    close_process_groups()
    times["close_s"] = time.perf_counter() - t3
    times["total_s"] = time.perf_counter() - t0
    return times


def main() -> int:
    rounds_wanted, out = int(sys.argv[1]), sys.argv[2]
    from megatron.training import jit_ops
    jit_ops.disable_unused_ops()  # as the trainer: no JIT build of DeepSpeed's unused ops
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    os.environ["MASTER_PORT"] = str(store.port)
    results = [one_round(store, number, device) for number in range(rounds_wanted)]
    with open(out, "w") as f:
        json.dump({"device": str(device), "rounds": results}, f, indent=1)
    return 0 if all(r["sum_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
