"""A rank of the resume-tag tests: ``load_checkpoint`` with a stand-in engine.

``python resume_worker.py OUT LOAD_DIR FAULT``: every rank resumes from LOAD_DIR (a
DeepSpeed-format directory the test made); FAULT is ``none``, ``rank1-sees-no-latest``
(rank 1's ``find_latest_tag`` returns None, as when ``latest`` appears while the ranks
start) or ``rank0-read-error`` (rank 0's raises OSError, as an object store's transient
failure). Writes ``<OUT>/rank<R>.json``: the resumed iteration, or the error.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from megatron.training import checkpointing  # noqa: E402


class _Engine:
    """What load_checkpoint uses of a DeepSpeed engine without MoC: load_checkpoint."""

    moc = None

    def load_checkpoint(self, load_dir, tag=None, **_):
        return os.path.join(load_dir, tag), {
            "opt_param_scheduler": {}, "iteration": int(tag[len("global_step"):]),
            "consumed_train_samples": 0, "rng_states": None}


class _Scheduler:
    def load_state_dict(self, state):
        pass


def main():
    out, load_dir, fault = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if fault == "rank1-sees-no-latest" and rank == 1:
        checkpointing.find_latest_tag = lambda d: None
    if fault == "rank0-read-error" and rank == 0:
        def failing(d):
            raise OSError(5, "Input/output error", os.path.join(d, "latest"))
        checkpointing.find_latest_tag = failing
    args = argparse.Namespace(load=load_dir, moc_two_level=False, moc_checkpoint=False,
                              no_load_optim=False, no_load_rng=True, moe_expert_parallel_size=1)
    try:
        state = checkpointing.load_checkpoint(_Engine(), args, _Scheduler())
        result = {"iteration": state.iteration}
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # the training's next collective: every rank must get here
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron.training.exit import exit_without_teardown  # noqa: E402
    exit_without_teardown(0)
