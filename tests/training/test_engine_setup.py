"""What a run's end frees (megatron.training.engine_setup.release_engine's parts)."""

import gc
import weakref

import torch

from megatron.training.engine_setup import drop_pipeline_buffers


class _Engine:
    pass


def _engine_with_an_activation_in_flight():
    """A stage between a forward and its backward: the output kept for the gradient,
    hooked (as DeepSpeed hooks its outputs) by a closure that holds the engine."""
    engine = _Engine()
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad, engine=engine: grad)
    engine.pipe_buffers = {"inputs": [(x, y)], "outputs": [y, None]}
    return weakref.ref(engine), engine


def test_an_activation_in_flight_no_longer_keeps_the_engine_alive():
    """The cycle runs through autograd's graph, which the collector cannot see: without
    the drop the engine (and the groups it holds) outlives a collection."""
    kept, engine = _engine_with_an_activation_in_flight()
    del engine
    gc.collect()
    assert kept() is not None  # the leak this guards against
    freed, engine = _engine_with_an_activation_in_flight()
    assert drop_pipeline_buffers(engine) == 2
    assert engine.pipe_buffers == {"inputs": [None], "outputs": [None, None]}
    del engine
    gc.collect()
    assert freed() is None
    assert drop_pipeline_buffers(_Engine()) == 0  # not a pipeline engine
