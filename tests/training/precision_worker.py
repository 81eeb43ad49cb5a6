"""A rank of ``pretrain_gpt_moe.py`` on a device without some precisions.

``precision_worker.py ANSWERS TRAINER_ARGS...``: ``ANSWERS`` such as ``fp16=no,bf16=yes``
is what this rank's DeepSpeed accelerator then says it supports, whatever this machine
has (the CPU accelerator says no fp16 on a CPU whose oneDNN has no float16 kernels, the
CUDA one no bf16 on a GPU older than compute capability 8.0); then the trainer runs as
the entry point does and the rank exits with its exit code. The patch is on this process's accelerator
object only: no code of the trainer knows about it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from deepspeed.accelerator import get_accelerator  # noqa: E402

import pretrain_gpt_moe  # noqa: E402
from megatron.training.exit import exit_without_teardown  # noqa: E402


def _answer(answers: str) -> None:
    accelerator = get_accelerator()
    for item in answers.split(","):
        dtype, answer = item.split("=")
        setattr(accelerator, f"is_{dtype}_supported", {"yes": lambda: True,
                                                        "no": lambda: False}[answer])


if __name__ == "__main__":
    _answer(sys.argv[1])
    exit_without_teardown(pretrain_gpt_moe.main(sys.argv[2:]))
