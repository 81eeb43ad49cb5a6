"""Boundaries of :mod:`deepspeed_ext.format.vocab` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/format``)."""

import dataclasses

import pytest

from deepspeed_ext.format.vocab import PaddedVocab, RowPlan


def test_a_vocabulary_without_a_real_row_is_refused():
    with pytest.raises(ValueError, match="need 0 < real_rows <= rows, got 0 of 8"):
        PaddedVocab(("embed.weight",), 8, 0)
    assert PaddedVocab(("embed.weight",), 8, 1).real_rows == 1


def test_a_row_plan_is_a_value():
    plan = RowPlan(("embed.weight",), saved_rows=8, rows=16, real_rows=5)
    assert hash(plan) == hash(RowPlan(("embed.weight",), 8, 16, 5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rows = 8
