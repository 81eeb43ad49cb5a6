"""Shared toy cluster for the planning tests: round numbers so every cost is hand-computable.

Per-rank figures of the toy cluster (8 GPUs, 4 per node, EP 8; 2 nodes):

* full state per rank: (1e6 + 8e6) params * 12 B / 8 ranks = 13.5e6 B
* storage write per rank: 0.4 GB/s per node / 4 ranks = 1e8 B/s
* storage read per rank:  0.8 GB/s / 4 = 2e8 B/s
* network per rank:       1 GB/s / 4 = 2.5e8 B/s
* device-to-host:         1 GB/s = 1e9 B/s; host-to-device 2 GB/s = 2e9 B/s
* forward+backward:       0.5 * 1 s = 0.5 s
"""

import io
import os
import subprocess

import pytest

from deepspeed_ext.planning.costs import Hardware, Layout, ModelShape

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
CONFIG_16E = os.path.join(REPO, "configs", "gpt-350m-16e.yaml")
"""A real training config (16 experts, batch 256 of micro-batches of 4)."""

REAL_RUN = subprocess.run
"""subprocess.run before :func:`model_shape_in_process` replaces it (the test of the real
entry point puts it back)."""


@pytest.fixture(autouse=True)
def model_shape_in_process(monkeypatch):
    """The model shape moc-plan asks of this project's own pretrain_gpt_moe.py
    (``--model-shape``) answered in this process by the same function the program runs,
    so the planning tests start no process (importing torch each time): the request and
    the answer still cross as the JSON the program reads and writes. Any other command
    runs for real."""
    from deepspeed_ext.planning.cli import MODEL_SHAPE
    from megatron.training.model_shape import answer
    ours = os.path.join(REPO, "pretrain_gpt_moe.py")

    def run(cmd, *args, **kwargs):
        if (len(cmd) == 3 and cmd[2] == MODEL_SHAPE
                and os.path.abspath(cmd[1]) == os.path.abspath(ours)):
            out = io.StringIO()
            status = answer(io.StringIO(kwargs.get("input") or ""), out)
            return subprocess.CompletedProcess(cmd, status, out.getvalue(), "")
        return REAL_RUN(cmd, *args, **kwargs)
    monkeypatch.setattr(subprocess, "run", run)


def toy_model(**overrides) -> ModelShape:
    values = dict(name="toy", params_non_expert=1_000_000, params_expert=8_000_000,
                  num_experts=8, num_moe_layers=2, tokens_per_iteration=1000)
    values.update(overrides)
    return ModelShape(**values)


def toy_hardware(**overrides) -> Hardware:
    values = dict(iteration_s=1.0, d2h_gbps=1.0, h2d_gbps=2.0, storage_write_gbps=0.4,
                  storage_read_gbps=0.8, storage_total_gbps=0.0, network_gbps=1.0,
                  restart_s=10.0, fwd_bwd_fraction=0.5, node_replace_s=0.0)
    values.update(overrides)
    return Hardware(**values)


@pytest.fixture
def model() -> ModelShape:
    return toy_model()


@pytest.fixture
def layout() -> Layout:
    return Layout(gpus=8, gpus_per_node=4, ep=8)


@pytest.fixture
def hw() -> Hardware:
    return toy_hardware()
