"""Boundaries of :mod:`deepspeed_ext.format.copy_plan` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import logging

import torch

from deepspeed_ext.format.copy_plan import plan_copies, run_copies
from deepspeed_ext.format.image import layout_of


def test_one_entry_runs_are_copied_without_a_stale_run_line(caplog):
    # A run of one entry is copied by itself by design, not because its plan went stale.
    base = torch.randn(4, 6)
    tensors = {"a": base[:, :3], "b": base[:, 3:]}
    layout = layout_of(tensors, keep_order=True)
    plan = plan_copies(layout, tensors)
    assert all(len(run.keys) == 1 for run in plan.runs)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with caplog.at_level(logging.DEBUG, logger="deepspeed_ext.format.copy_plan"):
        assert run_copies(buffer, layout, plan, tensors) == 1 + len(plan.runs)
    assert "stale" not in caplog.text
