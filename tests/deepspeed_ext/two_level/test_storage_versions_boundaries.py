"""Boundaries of :mod:`deepspeed_ext.two_level.storage_versions` found by mutation
testing (``bash scripts/mutation.sh deepspeed_ext/two_level``), on checkpoints saved in
this process."""

from deepspeed_ext.store.latest import update_latest
from deepspeed_ext.two_level.storage_versions import StorageVersions, newest_stored_step
from tests.deepspeed_ext.format.test_manifest import ALL_EXPERTS, FakeRun


def _three(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    run.save("global_step20", 20, 2, [(0, 1)])
    run.save("global_step30", 30, 2, [(1, 2)])
    update_latest(str(tmp_path), "global_step30")


def test_the_newest_stored_step_is_latests_or_none(tmp_path):
    assert newest_stored_step(str(tmp_path / "none")) is None
    assert newest_stored_step(str(tmp_path)) is None
    _three(tmp_path)
    assert newest_stored_step(str(tmp_path)) == 30
    (tmp_path / "latest").write_text("../elsewhere")
    assert newest_stored_step(str(tmp_path)) is None   # unreadable: memory decides


def test_versions_come_from_latest_when_it_is_not_newer_than_the_step(tmp_path):
    _three(tmp_path)
    versions = StorageVersions(str(tmp_path), 30)
    assert versions.latest == "global_step30"
    assert versions.base_tag() == "global_step30"
    assert versions.versions[(0, 1)] == 20 and versions.versions[(1, 2)] == 30
    assert versions.versions[(0, 0)] == 10 and len(versions.versions) == len(ALL_EXPERTS)


def test_versions_come_from_the_newest_checkpoint_at_or_before_an_older_step(tmp_path):
    _three(tmp_path)
    for step, tag in ((29, "global_step20"), (20, "global_step20"), (10, "global_step10")):
        versions = StorageVersions(str(tmp_path), step)
        assert versions.base_tag() == tag, step
    assert StorageVersions(str(tmp_path), 20).versions[(1, 2)] == 10
    assert StorageVersions(str(tmp_path), 9).base_tag() is None
    assert StorageVersions(str(tmp_path), 9).versions == {}


def test_a_dangling_or_damaged_latest_falls_back_to_the_newest_complete(tmp_path):
    _three(tmp_path)
    (tmp_path / "latest").write_text("global_step40")   # never committed
    assert StorageVersions(str(tmp_path), 30).latest == "global_step30"
    (tmp_path / "latest").write_text("../elsewhere")
    versions = StorageVersions(str(tmp_path), 30)
    assert versions.latest == "global_step30" and versions.base_tag() == "global_step30"
    assert StorageVersions(str(tmp_path / "none"), 30).versions == {}
    assert StorageVersions(str(tmp_path / "none"), 30).latest is None


def test_the_reader_reads_the_chosen_checkpoint(tmp_path):
    _three(tmp_path)
    versions = StorageVersions(str(tmp_path), 25)
    assert versions.base_tag() == "global_step20"
    reader = versions.reader()
    try:
        assert reader.tag == "global_step20" and versions.reader() is reader
    finally:
        versions.close()


def test_versions_are_read_from_the_newest_older_checkpoint_of_several(tmp_path):
    _three(tmp_path)
    FakeRun(tmp_path).save("global_step40", 40, 2)
    update_latest(str(tmp_path), "global_step40")
    versions = StorageVersions(str(tmp_path), 35)   # latest is newer: 10, 20, 30 qualify
    assert versions.base_tag() == "global_step30"
    assert versions.versions[(1, 2)] == 30 and versions.versions[(0, 1)] == 20



def test_a_checkpoint_storage_cannot_read_leaves_the_next_persist_on_its_own(
        tmp_path, monkeypatch, caplog):
    """An I/O error reading the expert index (a flaky network file system) is not a
    crash of the recovery: no base checkpoint, and the log says why."""
    from deepspeed_ext.format import expert_index
    _three(tmp_path)
    versions = StorageVersions(str(tmp_path), 25)

    def unreadable(path):
        raise OSError(5, "Input/output error (test)", path)
    monkeypatch.setattr(expert_index, "read_expert_versions", unreadable)
    with caplog.at_level("INFO", logger="deepspeed_ext"):
        assert versions.base_tag() is None
    assert "no readable checkpoint at or before step 25" in caplog.text
    assert "OSError" in caplog.text and "Input/output error (test)" in caplog.text
