"""The reduced precisions this machine runs, for the tests that train in one.

DeepSpeed's accelerator answers, as the trainer asks it
(``megatron.training.precision``): a CPU whose oneDNN has no float16 kernels has no
fp16, a GPU older than compute capability 8.0 no bf16. A test that needs one skips where
it is missing, saying why; the refusal a run gets there is tested in
``tests/training/test_precision.py``.
"""

import pytest


def missing_reason(dtype: str) -> str:
    """``""`` where this machine runs ``dtype`` (``"fp16"`` or ``"bf16"``), else why not."""
    from deepspeed.accelerator import get_accelerator
    from megatron.training.precision import supported_precisions
    accelerator = get_accelerator()
    if supported_precisions(accelerator)[dtype]:
        return ""
    device = accelerator.device_name()
    why = f"DeepSpeed's {device} accelerator has no {dtype} on this machine"
    if (device, dtype) == ("cpu", "fp16"):
        why += " (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False)"
    return why + f": the trainer refuses --{dtype} here (tests/training/test_precision.py)"


def skip_without(dtype: str, rest: str) -> None:
    """Skip the calling test where this machine lacks ``dtype``; ``rest`` says which tests
    cover what it checks apart from the precision."""
    reason = missing_reason(dtype)
    if reason:
        pytest.skip(f"needs {dtype}: {reason}; {rest}")
