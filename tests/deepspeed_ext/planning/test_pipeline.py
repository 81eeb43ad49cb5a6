"""The pipeline recovery model (deepspeed_ext.planning.pipeline) and ``moc-plan pipeline``:
localized replay saves the 1F1B bubble, ``(M + P - 1) / M`` per step; the ETTR follows
MoEtion's formula."""

import json

import pytest

from deepspeed_ext.planning import pipeline as pm
from deepspeed_ext.planning.cli import main


def test_a_stage_replaying_alone_saves_the_bubble():
    p = pm.PipelineRecovery(stages=4, micro_batches=4, window=2, iteration_s=0.7)
    # one slot is 0.7 / (4 + 3) = 0.1 s; the stage alone needs 4 slots a step
    assert pm.replay_step_s(p, localized=True) == pytest.approx(0.4)
    assert pm.replay_step_s(p, localized=False) == pytest.approx(0.7)
    # 1.5 W = 3 steps replayed on average
    assert pm.recovery_s(p, localized=True) == pytest.approx(1.2)
    assert pm.recovery_s(p, localized=False, steps=4) == pytest.approx(2.8)
    row = pm.compare(p, mtbf_s=100.0)
    assert row["replay_speedup"] == pytest.approx(7 / 4)
    assert row["ettr_global"] == pytest.approx(1 / (1 + 2.1 / 100))


def test_downtime_restore_and_the_logs_overhead_count():
    p = pm.PipelineRecovery(stages=2, micro_batches=1, window=2, iteration_s=1.0,
                            restore_s=2.0, downtime_s=5.0, log_overhead_s=0.1)
    assert pm.recovery_s(p, localized=True) == pytest.approx(5 + 2 + 3 * 0.5)
    assert pm.ettr(p, 1000.0, localized=True) == pytest.approx(1 / 1.1 / (1 + 8.5 / 1000))
    assert pm.ettr(p, 1000.0, localized=False) == pytest.approx(1 / (1 + 10 / 1000))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(stages=1, micro_batches=4, window=2, iteration_s=1.0), "stages >= 2"),
    (dict(stages=2, micro_batches=4, window=2, iteration_s=0.0), "iteration_s must be > 0"),
    (dict(stages=2, micro_batches=4, window=2, iteration_s=1.0, restore_s=-1), "other times >= 0"),
])
def test_bad_figures_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        pm.PipelineRecovery(**kwargs)


def test_moc_plan_pipeline_prints_and_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["pipeline", "--stages", "8,16", "--micro-batches", "32", "--window", "8",
                 "--iteration-time", "6", "--mtbf", "600", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "12 steps replayed per failure on average" in printed
    rows = json.load(open(out))
    assert [r["stages"] for r in rows] == [8, 16]
    assert rows[1]["replay_speedup"] == pytest.approx(47 / 32)
    assert rows[1]["ettr_localized"] > rows[1]["ettr_global"]
    assert main(["pipeline", "--stages", "eight", "--micro-batches", "32", "--window", "8",
                 "--iteration-time", "6", "--mtbf", "600"]) == 2
    assert "--stages: expected integers" in capsys.readouterr().err
