"""Local rank processes of a benchmark: the launcher starts them, each runs a worker, and
rank 0 writes the results file the launcher reads back (even after a crash).

Rank side: :func:`run_worker`, :func:`host_barrier`, :func:`gather_objects`,
:func:`write_results`, :func:`finish_rank` (every rank calls the collectives in the same
order). Launcher side: :func:`prepare_out_dir`, :func:`run_rank_processes`,
:func:`read_results`, :func:`print_failed_rank_logs`, :func:`finish_out_dir`.
"""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_FILE = "results.json"


def run_worker(opts, worker) -> None:
    """A rank's entry: ``worker(opts, rank, world)``; a failure's traceback goes to
    ``error.rank<R>.txt`` for the launcher to report."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        worker(opts, rank, world)
    except BaseException:
        with open(os.path.join(opts.out_dir, f"error.rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def host_barrier() -> None:
    """Every rank: wait for this rank's queued device work, then a barrier on the metadata
    group (:mod:`deepspeed_ext.runtime.groups`, made by :func:`build_engine`'s
    ``initialize_distributed``). An NCCL barrier waited for the device too; the gloo one
    does not, and a timing started after it would otherwise pay for earlier kernels."""
    import torch
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier(group=metadata_group())


def gather_objects(value, world: int) -> list:
    """Every rank: ``value`` of every rank, in rank order (on the metadata group)."""
    import torch.distributed as dist
    from deepspeed_ext.runtime.groups import metadata_group
    gathered = [None] * world
    dist.all_gather_object(gathered, value, group=metadata_group())
    return gathered


def write_results(out_dir: str, results: dict) -> None:
    """Rank 0: the results so far, atomically (the launcher reads them even after a crash)."""
    tmp = os.path.join(out_dir, RESULTS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, os.path.join(out_dir, RESULTS_FILE))


def finish_rank() -> None:
    """Every rank, last: a barrier (no rank tears its groups down while another still
    uses them), DeepSpeed's shared-memory buffers removed (a rank that exits leaves them
    in ``/dev/shm`` otherwise), the process group destroyed."""
    import torch.distributed as dist
    host_barrier()
    from megatron.training.training import remove_deepspeed_shm_buffers
    remove_deepspeed_shm_buffers()
    dist.destroy_process_group()


def group_errors(errors) -> str:
    """``[(rank, message), ...]`` -> one line, ranks with the same message together."""
    by_message = {}
    for rank, message in errors:
        by_message.setdefault(message, []).append(rank)
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
                     for message, ranks in by_message.items())


def free_port() -> int:
    """A free TCP port on 127.0.0.1: the ranks' ``MASTER_PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_processes(argv: list, nproc: int, out_dir: str, timeout: float) -> tuple:
    """Start ``nproc`` local ranks of ``argv`` (logs in ``out_dir/logs``); wait at most
    ``timeout`` seconds, then kill what is left. Returns (exit codes, timed out?)."""
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    port = str(free_port())
    procs, handles = [], []
    for rank in range(nproc):
        # CROSS_RANK/CROSS_SIZE: what DeepSpeed's launcher sets on one node; its checkpoint
        # writers read them.
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), CROSS_RANK="0", CROSS_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONWARNINGS="ignore")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        log = open(os.path.join(logs, f"rank{rank}.log"), "w")
        handles.append(log)
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:  # only the processes started here
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in handles:
            log.close()
    return [p.returncode for p in procs], timed_out


def file_tail(path: str, lines: int = 25) -> str:
    """The last ``lines`` lines of the file at ``path`` ('' if unreadable)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def prepare_out_dir(out_dir, prefix: str) -> tuple:
    """The run's output directory: a new temporary one, or ``out_dir`` if it is empty or
    absent. Returns (absolute path, created here?).

    Raises:
        ValueError: ``out_dir`` exists and is not an empty directory (naming the flag).
    """
    if out_dir is None:
        return tempfile.mkdtemp(prefix=prefix), True
    out_dir = os.path.abspath(out_dir)
    created = not os.path.exists(out_dir)
    if not created and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"--out-dir {out_dir} must be an empty directory or absent")
    os.makedirs(out_dir, exist_ok=True)
    return out_dir, created


def read_results(out_dir: str, codes: list, timed_out: bool, timeout: float) -> tuple:
    """Rank 0's results file and, if the ranks did not all end well, why: (results, error)."""
    results = {}
    path = os.path.join(out_dir, RESULTS_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            results = json.load(f)
    if timed_out:
        return results, f"the ranks were killed after --timeout {timeout:g} s"
    if not any(codes) and results.get("complete"):
        return results, None
    errors = []
    for rank in range(len(codes)):
        path = os.path.join(out_dir, f"error.rank{rank}.txt")
        if os.path.isfile(path):
            last = [l for l in file_tail(path, 3).splitlines() if l.strip()]
            errors.append((rank, last[-1] if last else "?"))
    return results, f"rank exit codes {codes}" + (": " + group_errors(errors) if errors else "")


def print_failed_rank_logs(out_dir: str, codes: list, launch_error) -> None:
    """After a failed launch: the last lines of rank 0's log and the first failed rank's."""
    if not launch_error:
        return
    print(f"\nranks failed ({launch_error}); last lines of the rank logs:")
    failed = [r for r, code in enumerate(codes) if code]
    for rank in sorted({0, *failed[:1]}):
        tail = file_tail(os.path.join(out_dir, "logs", f"rank{rank}.log"), 15)
        if tail:
            print(f"--- rank {rank} (exit {codes[rank]}) ---\n{tail.rstrip()}")


def finish_out_dir(out_dir: str, created: bool, keep: bool) -> None:
    """Keep the output directory, delete it (created here), or empty it (the user's)."""
    if keep:
        print(f"kept {out_dir} (checkpoints under ckpt/, results.json, rank logs under logs/)")
    elif created:
        shutil.rmtree(out_dir, ignore_errors=True)
    else:  # an empty directory the user named: remove only what this run put there
        for name in os.listdir(out_dir):
            path = os.path.join(out_dir, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
