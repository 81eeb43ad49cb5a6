"""Small helpers shared by the data modules.

Importing anything under ``megatron.core`` runs ``megatron/core/__init__.py``, which
imports the optimizer and FSDP code and warns (once per process) that Transformer
Engine and Apex are missing, plus a few deprecation notices. Those warnings are
noise for data loading, so the data modules import megatron.core inside
:func:`quiet_core_import`, which filters only those messages and only for the
duration of the import (``warnings.catch_warnings`` restores the filters after).

The same import decorates a few dozen fused-kernel helpers with ``torch.compile``, which
:func:`quiet_core_import` defers (see :mod:`megatron.lazy_compile`).
"""

import contextlib
import warnings

# Messages emitted while importing megatron.core 0.16 on a machine without
# Transformer Engine / Apex; matched as regex prefixes by the warnings module.
_IMPORT_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"The following imports from `dynamic_context.py` will be removed",
    r"`torch.jit.script_method` is deprecated",
)


@contextlib.contextmanager
def quiet_core_import():
    """Import megatron.core quietly and cheaply: suppress its known import-time warnings
    (and nothing else) and defer the ``torch.compile`` calls of its import to each
    compiled function's first call (:func:`megatron.lazy_compile.compile_on_first_call`).

    Called by any code of this process before it imports from megatron.core; the
    import must run in the ``with`` block.
    """
    from megatron.lazy_compile import compile_on_first_call

    with warnings.catch_warnings(), compile_on_first_call():
        for message in _IMPORT_NOISE:
            warnings.filterwarnings("ignore", message=message)
        yield


def check_int(value, flag, minimum=None):
    """Return ``value`` as an int, or raise ConfigError naming ``flag``.

    Bools are rejected (``True`` is an int in Python but never a sensible count).
    """
    from megatron.errors import ConfigError

    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers and the like are fine as long as they are integral.
        try:
            as_int = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag} must be an integer, got {value!r}") from None
        if isinstance(value, bool) or as_int != value:
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
        value = as_int
    if minimum is not None and value < minimum:
        raise ConfigError(f"{flag} must be >= {minimum}, got {value}")
    return value
