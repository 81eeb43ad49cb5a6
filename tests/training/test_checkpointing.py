"""Which checkpoint to resume from is decided once, by rank 0, for every rank: a rank
that would read ``latest`` differently (or fail to read it) cannot send the ranks down
different paths through the load's collectives."""

import json

import pytest

from megatron.training.checkpointing import META_FILE
from tests.launch import describe, run_ranks

WORKER = "tests/training/resume_worker.py"


def _resume(tmp_path, fault):
    load = tmp_path / "ckpt"
    (load / "global_step5").mkdir(parents=True)
    (load / "global_step5" / META_FILE).write_text(json.dumps({"args": {}, "world_size": 2}))
    (load / "latest").write_text("global_step5")
    out = tmp_path / "out"
    out.mkdir()
    results = run_ranks(2, [str(out), str(load), fault], script=WORKER, timeout=120)
    assert all(r.returncode == 0 for r in results), describe(results)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("fault", ["none", "rank1-sees-no-latest"])
def test_every_rank_resumes_from_the_tag_rank_0_read(tmp_path, fault):
    assert _resume(tmp_path, fault) == [{"iteration": 5}, {"iteration": 5}]


def test_rank_0_failing_to_read_latest_is_an_error_on_every_rank(tmp_path):
    results = _resume(tmp_path, "rank0-read-error")
    for result in results:
        assert "rank 0 could not read which checkpoint" in result.get("error", ""), results
        assert "Input/output error" in result["error"]
