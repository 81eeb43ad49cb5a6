"""``torch.compile`` deferred to a function's first call, for imports that decorate.

megatron.core (its fused-kernel helpers, ``megatron.core.jit.jit_fuser``) and DeepSpeed
(its Muon optimizer's update functions) apply ``torch.compile`` when their modules are
imported, and the first ``torch.compile`` call in a process imports TorchDynamo and
Inductor: about 1.5 s of CPU each time a rank starts, for functions this project never
calls (its model and optimizer are its own). Importing such modules inside
:func:`compile_on_first_call` leaves each decorated function uncompiled until it is
first called, when it is compiled with the same options: a caller still runs the
compiled function, and a process that never calls one never loads the compiler.
"""

import contextlib
import functools
import importlib
import inspect
from typing import Callable

# DeepSpeed modules that torch.compile at import and that its ZeRO optimizers import on
# their first step; imported ahead by the trainer, inside compile_on_first_call.
DEEPSPEED_COMPILING_MODULES = ("deepspeed.runtime.zero.muon.original_muon",)


def _deferring(compile_now: Callable) -> Callable:
    """A stand-in for ``torch.compile`` that compiles a function on its first call."""

    def compile_later(model=None, **options):
        if model is None:  # used as ``@torch.compile(mode=...)``
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):  # a module or another callable: compile now
            return compile_now(model, **options)
        compiled = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            if not compiled:
                compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)

        return first_call_compiles

    return compile_later


@contextlib.contextmanager
def compile_on_first_call():
    """Within the block, ``torch.compile(fn, ...)`` returns ``fn`` compiled on first call.

    Called by the importing thread around imports only (``torch.compile`` is a process
    global and is restored on leaving the block, also on an error).
    """
    import torch

    compile_now = torch.compile
    torch.compile = _deferring(compile_now)
    try:
        yield
    finally:
        torch.compile = compile_now


def import_deferring_compile(*names: str) -> None:
    """Import each module in ``names`` that exists, inside :func:`compile_on_first_call`.

    A module this DeepSpeed version lacks is skipped: the import only saves time.
    """
    with compile_on_first_call():
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
