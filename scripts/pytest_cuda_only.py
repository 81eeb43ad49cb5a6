"""pytest plugin for ``scripts/gpu_check.py``: keep only the tests that are skipped where
no CUDA device is present (a ``skipif`` mark whose reason names CUDA or a GPU), so one
GPU run spends its minutes on the CUDA paths, not on the CPU suite it shares files with.

    python -m pytest -p pytest_cuda_only tests/...   (with scripts/ on PYTHONPATH)
"""

import re

CUDA_REASON = re.compile(r"\b(cuda|gpu)s?\b", re.IGNORECASE)


def needs_cuda(item) -> bool:
    """Whether ``item`` carries a skipif mark whose reason names CUDA or a GPU."""
    for mark in item.iter_markers(name="skipif"):
        if CUDA_REASON.search(str(mark.kwargs.get("reason", ""))):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if needs_cuda(item)]
    dropped = [item for item in items if not needs_cuda(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
