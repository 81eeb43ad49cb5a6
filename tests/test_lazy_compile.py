"""megatron.lazy_compile: torch.compile deferred to a function's first call."""

import pytest
import torch

from megatron import lazy_compile
from tests.launch import fresh_python


@pytest.fixture
def fake_compile(monkeypatch):
    """torch.compile replaced by a recorder: each call is logged, the result tags fn."""
    calls = []

    def compile_now(model=None, **options):
        calls.append((model, options))

        def compiled(*args, **kwargs):
            return ("compiled", model(*args, **kwargs))

        return compiled

    monkeypatch.setattr(torch, "compile", compile_now)
    return calls


def test_a_function_compiles_on_its_first_call_with_its_options(fake_compile):
    def double(x):
        return 2 * x

    with lazy_compile.compile_on_first_call():
        later = torch.compile(double, mode="max-autotune")

        @torch.compile(dynamic=True)
        def triple(x):
            return 3 * x

    assert fake_compile == []  # nothing compiled at "import"
    assert later(4) == ("compiled", 8) and later(5) == ("compiled", 10)
    assert triple(2) == ("compiled", 6)
    assert fake_compile == [(double, {"mode": "max-autotune"}), (triple.__wrapped__, {"dynamic": True})]
    assert later.__name__ == "double"


def test_a_module_compiles_at_once_and_torch_compile_is_restored(fake_compile):
    real = torch.compile
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError):
        with lazy_compile.compile_on_first_call():
            torch.compile(layer)
            assert torch.compile is not real
            raise RuntimeError("an import failed")
    assert fake_compile == [(layer, {})]
    assert torch.compile is real  # restored on the error too


def test_importing_megatron_core_and_deepspeed_muon_loads_no_compiler():
    """What the deferral is for: a rank that imports what the trainer imports never
    imports Inductor (about 1.5 s of CPU per rank process)."""
    code = (
        "import sys\n"
        "from megatron.data.compat import quiet_core_import\n"
        "from megatron import lazy_compile\n"
        "with quiet_core_import():\n"
        "    import megatron.core.optimizer_param_scheduler, megatron.core.datasets.gpt_dataset\n"
        "lazy_compile.import_deferring_compile(*lazy_compile.DEEPSPEED_COMPILING_MODULES,\n"
        "                                      'no_such_module_for_this_test')\n"
        "import deepspeed.runtime.zero.muon.original_muon as m\n"
        "print('inductor' if 'torch._inductor.compile_fx' in sys.modules else 'none',\n"
        "      callable(m.muon_update))\n")
    assert fresh_python(code)[-1].split() == ["none", "True"]
