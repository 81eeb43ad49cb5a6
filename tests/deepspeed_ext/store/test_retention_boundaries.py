"""Boundaries of :mod:`deepspeed_ext.store.retention` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

import os

from deepspeed_ext.format import fs
from deepspeed_ext.store.pins import reading
from deepspeed_ext.store.retention import (TRASH_PREFIX, apply_retention, holds_only_moc_files,
                                           remove_checkpoint)
from tests.deepspeed_ext.commit_helpers import commit_two_ranks


def test_removing_a_checkpoint_without_a_manifest_removes_its_folder(tmp_path):
    # A crashed save (or an interrupted removal): no manifest to remove first.
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "global_step5" / "rank00000.safetensors").write_bytes(b"x")
    remove_checkpoint(str(tmp_path), "global_step5")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_cannot_be_listed_holds_no_moc_files(tmp_path):
    assert not holds_only_moc_files(str(tmp_path / "gone"))
    assert holds_only_moc_files(str(tmp_path))   # empty: nothing that is not ours


def test_retention_removes_leftover_trash_and_knows_no_folder(tmp_path):
    assert apply_retention(str(tmp_path / "never-made"), 1) == []
    commit_two_ranks(str(tmp_path), "global_step10", 10, 1.0)
    trash = tmp_path / f"{TRASH_PREFIX}global_step5.123.456"
    trash.mkdir()
    (trash / "rank00000.safetensors").write_bytes(b"x")
    assert apply_retention(str(tmp_path), 1) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step10"]


def test_a_crashed_saves_file_vanishing_during_retention_is_passed_over(tmp_path, monkeypatch):
    crashed = tmp_path / "global_step5"
    crashed.mkdir()
    for rank in range(2):
        (crashed / f"rank{rank:05d}.safetensors").write_bytes(b"x")
        os.utime(crashed / f"rank{rank:05d}.safetensors", (1.0, 1.0))   # long before
    commit_two_ranks(str(tmp_path), "global_step10", 10, 1.0)
    real = fs.mtime

    def mtime(path):   # rank 1's file is deleted between the listing and its mtime
        if path.endswith("rank00001.safetensors"):
            raise FileNotFoundError(path)
        return real(path)
    monkeypatch.setattr(fs, "mtime", mtime)
    assert apply_retention(str(tmp_path), 1) == ["global_step5"]


def test_retention_spares_a_pinned_checkpoint_and_a_folder_with_foreign_files(tmp_path):
    old = tmp_path / "global_step1"
    old.mkdir()
    (old / "notes.txt").write_text("mine")   # no manifest, not only MoC's files
    os.utime(old / "notes.txt", (1.0, 1.0))
    for step in (10, 20):
        commit_two_ranks(str(tmp_path), f"global_step{step}", step, 1.0)
    with reading(str(tmp_path), "global_step10"):
        assert apply_retention(str(tmp_path), 1) == []
    assert apply_retention(str(tmp_path), 1) == ["global_step10"]
    assert (old / "notes.txt").exists()
