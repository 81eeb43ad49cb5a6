"""Whether this device can run the precision the run asks for (``--fp16``, ``--bf16``).

DeepSpeed's accelerator answers for the device: on CPU, fp16 needs float16 kernels in
torch's oneDNN, which some x86 CPUs lack (an AMD EPYC, for one:
``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` is False there); on CUDA, fp16 needs
compute capability 7.0 and bf16 what ``torch.cuda.is_bf16_supported()`` says. Without
this check DeepSpeed's engine raised ``ValueError: Type bf16 is not supported on your
device.`` with a traceback on every rank (exit 1), after the data and the model were
built.
"""

import argparse

from megatron.errors import ConfigError
from megatron.training.megatron_compat import was_given

PRECISIONS = ("fp16", "bf16")
"""The reduced precisions, as ``args`` attributes, flags (``--fp16``) and DeepSpeed config
sections (``fp16.enabled``)."""


def supported_precisions(accelerator) -> dict:
    """``{"fp16": bool, "bf16": bool}``: what DeepSpeed's ``accelerator`` says it can run
    (its CPU accelerator answers None for "no" fp16)."""
    return {"fp16": bool(accelerator.is_fp16_supported()),
            "bf16": bool(accelerator.is_bf16_supported())}


def check_precision(args: argparse.Namespace, accelerator) -> None:
    """Refuse ``--fp16``/``--bf16`` (or a ``--deepspeed_config`` section enabling one)
    that ``accelerator`` cannot run.

    Every rank calls it, after selecting its device and before the process group: each
    rank asks its own device, so on a machine without the kernels every rank refuses and
    none waits in a rendezvous for the others.

    Args:
        args: validated arguments (``validate_args`` has taken a ``--deepspeed_config``
            file's ``fp16``/``bf16`` sections into ``args.fp16``/``args.bf16``).
        accelerator: DeepSpeed's accelerator of this rank's device.

    Raises:
        ConfigError: naming the flag (or the file's key) and what this device runs instead.
    """
    supported = supported_precisions(accelerator)
    for dtype in PRECISIONS:
        if getattr(args, dtype, False) and not supported[dtype]:
            device = accelerator.device_name()
            raise ConfigError(precision_refusal(args, dtype, device, supported))


def precision_refusal(args: argparse.Namespace, dtype: str, device: str,
                      supported: dict) -> str:
    """The refusal of ``dtype`` on ``device``: the flag or file key that asked for it,
    why, and the precisions this device does run."""
    other = "bf16" if dtype == "fp16" else "fp16"
    path = getattr(args, "deepspeed_config", None)
    if path and not was_given(args, dtype):
        asked = f"{dtype}.enabled = true in --deepspeed_config {path}"
        use_other = f"enable {other} there instead"
        drop = f"set {dtype}.enabled to false there to train in fp32"
    else:
        asked, use_other = f"--{dtype}", f"use --{other}"
        drop = f"leave out --{dtype} to train in fp32"
    why = f"DeepSpeed's {device} accelerator reports no {dtype} support"
    if (device, dtype) == ("cpu", "fp16"):
        why += "; torch's oneDNN has no float16 kernels for this CPU"
    instead = (f"{use_other}, or {drop}" if supported[other]
               else f"{drop} (it has no {other} either)")
    return f"{asked} is not supported on this {device} device ({why}): {instead}"
