"""A rank of the mpu test: megatron-core's parallel_state with T = 2, the adapter, and
DeepSpeed's expert groups created from it (expert tensor parallelism, E = 2); writes
OUT_DIR/rank<R>.json with what each reports.

    mpu_worker.py OUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    from megatron.data.compat import quiet_core_import
    with quiet_core_import():
        from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    from megatron.training.mpu import CoreMPU
    mpu = CoreMPU()
    import deepspeed
    from deepspeed.utils import groups
    from megatron.training import jit_ops
    # as the trainer: no JIT build of DeepSpeed's shm op (a cold build held the ranks
    # 25-35 s, and every checkout of a venv rebuilt it)
    jit_ops.disable_unused_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    groups.mpu = mpu  # as deepspeed.initialize(mpu=...) sets it
    groups._create_expert_data_and_model_parallel(2, mpu=mpu)
    report = {
        "tp_rank": mpu.get_model_parallel_rank(), "tp_size": mpu.get_model_parallel_world_size(),
        "dp_rank": mpu.get_data_parallel_rank(), "dp_size": mpu.get_data_parallel_world_size(),
        "pp_size": mpu.get_pipeline_model_parallel_world_size(),
        "tp_group": dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()),
        "dp_group": mpu.get_data_parallel_group_ranks(),
        "ep_group": dist.get_process_group_ranks(groups._get_expert_parallel_group("ep_size_2")),
        "ep_dp_group": dist.get_process_group_ranks(groups._get_expert_data_parallel_group("ep_size_2")),
    }
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    from megatron.training.exit import exit_without_teardown
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
