"""``--deterministic``: the settings under which a run repeats itself bit for bit.

Exact recovery replays a window of iterations and must reproduce the original run's
bytes, and a resumed run is compared with an uninterrupted one bitwise. On CPU the
kernels this model uses are deterministic already. On CUDA they are not by default:
cuBLAS splits reductions by workspace, several ops choose atomics, and the flash and
memory-efficient backward kernels of ``F.scaled_dot_product_attention`` accumulate in a
nondeterministic order. :func:`apply` switches all of that off, on every rank, before
the model is built:

* ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic
  implementation raises instead of running nondeterministically);
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (must be set before cuBLAS is first used);
* scaled-dot-product attention restricted to the math backend (flash, memory-efficient
  and cuDNN backends off);
* cuDNN deterministic, no benchmark autotuning.

Guarantees, with the same code, data, world size and device model: bitwise on CPU
(always) and on CUDA under ``--deterministic``; not across device models, driver or
library versions, or world sizes.
"""

import os
from typing import List

import torch

CUBLAS_WORKSPACE = ":4096:8"


def wanted(deterministic_flag: bool, moc_mode: str, on_cuda: bool) -> bool:
    """Whether a run uses the deterministic settings: asked for, or implied by exact
    recovery on CUDA (its replay must reproduce the original bytes)."""
    return bool(deterministic_flag) or (moc_mode == "exact" and on_cuda)


def apply(on_cuda: bool) -> List[str]:
    """Switch the process to deterministic kernels; returns what was set (for the log).
    Every rank calls it, before building the model and before any CUDA work."""
    done = []
    if on_cuda:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        done.append(f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}")
        backends = torch.backends.cuda
        backends.enable_flash_sdp(False)
        backends.enable_mem_efficient_sdp(False)
        if hasattr(backends, "enable_cudnn_sdp"):
            backends.enable_cudnn_sdp(False)
        backends.enable_math_sdp(True)
        done.append("attention: math backend only")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        done.append("cuDNN deterministic")
    torch.use_deterministic_algorithms(True)
    done.append("torch.use_deterministic_algorithms(True)")
    return done
