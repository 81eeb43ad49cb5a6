"""--deterministic: which runs use deterministic kernels, and that a run trains under them."""

import os

import pytest
import torch

from megatron.training import determinism
from tests.launch import describe, run_ranks

TINY = ["--config", "configs/tiny.yaml", "--split", "90,10,0"]


def test_asked_for_or_implied_by_exact_recovery_on_cuda():
    assert determinism.wanted(True, "pec", on_cuda=False)
    assert determinism.wanted(False, "exact", on_cuda=True)
    assert not determinism.wanted(False, "exact", on_cuda=False)  # CPU: deterministic anyway
    assert not determinism.wanted(False, "pec", on_cuda=True)


def test_apply_switches_torch_to_deterministic_algorithms(monkeypatch):
    before = torch.are_deterministic_algorithms_enabled()
    try:
        done = determinism.apply(on_cuda=False)
        assert torch.are_deterministic_algorithms_enabled()
        assert "torch.use_deterministic_algorithms(True)" in done
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_apply_on_cuda_sets_the_cublas_workspace_and_math_attention(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        determinism.apply(on_cuda=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.use_deterministic_algorithms(before)
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)


def test_a_deterministic_run_trains_and_matches_the_default_one(corpus, tmp_path):
    """Every op of a 2-rank expert-parallel run has a deterministic CPU implementation (an
    op without one would raise under --deterministic), and on CPU the flag changes no
    result: the losses are bitwise those of the run without it."""
    losses = {}
    for name, extra in (("default", []), ("deterministic", ["--deterministic"])):
        metrics = tmp_path / f"{name}.jsonl"
        results = run_ranks(2, TINY + ["--data-path", corpus, "--train-iters", "3",
                                       "--metrics-file", str(metrics)] + extra, timeout=240)
        assert all(r.returncode == 0 for r in results), describe(results)
        losses[name] = [line for line in metrics.read_text().splitlines() if '"train"' in line]
    assert "deterministic kernels" in results[0].output
    assert losses["deterministic"] == losses["default"] and losses["default"]
