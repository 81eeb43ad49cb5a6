"""Boundaries of :mod:`deepspeed_ext.store.latest` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

import pytest

from deepspeed_ext.format.errors import CheckpointError
from deepspeed_ext.store import latest
from tests.deepspeed_ext.commit_helpers import commit_two_ranks


def test_rolling_latest_forward_passes_over_a_checkpoint_gone_unreadable(tmp_path, monkeypatch):
    """global_step20's manifest goes bad between the scan and its second read (retention
    or a repair in another process): the roll goes on to the attempt's global_step30."""
    save_dir = str(tmp_path)
    for step in (10, 20, 30):
        commit_two_ranks(save_dir, f"global_step{step}", step, 1.0, attempt_started=100.0)
    latest.update_latest(save_dir, "global_step10")
    real = latest.read_manifest

    def read_manifest(tag_dir):   # the scan (catalog's own import) read it fine before
        if tag_dir.endswith("global_step20"):
            raise CheckpointError(f"{tag_dir}/manifest.json: missing")
        return real(tag_dir)
    monkeypatch.setattr(latest, "read_manifest", read_manifest)
    latest.record_attempt(save_dir, 200.0)
    assert latest.read_latest(save_dir) == "global_step30"


def test_rolling_latest_forward_goes_to_the_attempts_newest_checkpoint(tmp_path):
    save_dir = str(tmp_path)
    for step in (10, 20, 30):
        commit_two_ranks(save_dir, f"global_step{step}", step, 1.0, attempt_started=100.0)
    latest.update_latest(save_dir, "global_step10")
    latest.record_attempt(save_dir, 200.0)
    assert latest.read_latest(save_dir) == "global_step30"


def test_only_an_attempt_started_later_counts_as_later(tmp_path):
    latest.record_attempt(str(tmp_path), 100.0)
    assert latest.later_attempt_started(str(tmp_path), 50.0)
    assert not latest.later_attempt_started(str(tmp_path), 100.0)
    assert not latest.later_attempt_started(str(tmp_path), 200.0)


def test_a_latest_that_cannot_be_read_as_text_is_a_checkpoint_error(tmp_path):
    (tmp_path / "latest").mkdir()   # OSError (a directory)
    with pytest.raises(CheckpointError, match="latest: unreadable"):
        latest.read_latest(str(tmp_path))
    (tmp_path / "latest").rmdir()
    (tmp_path / "latest").write_bytes(b"\xff\xfeglobal_step1")   # not UTF-8
    with pytest.raises(CheckpointError, match="latest: unreadable"):
        latest.read_latest(str(tmp_path))


def test_a_new_checkpoint_extends_the_tag_last_saved_or_loaded_in_its_directory(tmp_path):
    assert latest.extended_tag((str(tmp_path), "global_step10"), str(tmp_path)) == "global_step10"
    assert latest.extended_tag((str(tmp_path / "other"), "global_step10"), str(tmp_path)) is None
    assert latest.extended_tag(None, str(tmp_path)) is None
