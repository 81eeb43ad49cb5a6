"""A CPU without fp16 or bf16, for a whole test-suite run: DeepSpeed's CPU accelerator
answers no to both in every process that imports it (ranks and launchers included).

    PYTHONPATH=tests/no_half_precision bash scripts/test.sh

Python imports ``sitecustomize`` at start-up from the path; this one patches the
accelerator class as its module is loaded, so nothing is imported early. What the trainer
and the tests do on such a machine: docs/testing.md.
"""
import importlib.abc
import sys

TARGET = "deepspeed.accelerator.cpu_accelerator"


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            module.CPU_Accelerator.is_bf16_supported = lambda self: False
            module.CPU_Accelerator.is_fp16_supported = lambda self: False
        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
