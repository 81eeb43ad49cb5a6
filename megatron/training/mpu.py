"""The ``mpu`` object DeepSpeed takes, over megatron-core's ``parallel_state``.

DeepSpeed (``deepspeed.initialize(mpu=...)`` and its MoE group creation) asks an mpu for
model-, tensor- and data-parallel ranks, sizes and groups under several names, some of
which megatron-core 0.16's ``parallel_state`` lacks (``get_model_parallel_rank``,
``get_model_parallel_world_size``, ``get_data_parallel_group_ranks``). Without pipeline
parallelism the model-parallel group is the tensor-parallel group. No sequence-parallel
method is offered: DeepSpeed checks for them by name and would then split sequences.

Every rank builds one after ``parallel_state.initialize_model_parallel`` and passes it to
``deepspeed.initialize``.
"""

from typing import List

import torch.distributed as dist


class CoreMPU:
    """DeepSpeed's view of megatron-core's tensor- and data-parallel groups."""

    def __init__(self):
        from megatron.data.compat import quiet_core_import
        with quiet_core_import():
            from megatron.core import parallel_state
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("megatron-core's parallel_state is not initialised: call "
                               "initialize_model_parallel on every rank first")
        self._ps = parallel_state

    # Tensor (= model, without pipeline parallelism) parallel.
    def get_tensor_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_src_rank()

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    # Data parallel.
    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group()

    def get_data_parallel_group_ranks(self) -> List[int]:
        return dist.get_process_group_ranks(self.get_data_parallel_group())

    # Pipeline parallel: none.
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_group(self):
        return self._ps.get_pipeline_model_parallel_group()
