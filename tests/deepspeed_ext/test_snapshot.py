"""Snapshot slots in shared memory (deepspeed_ext.snapshot): what counts as complete when
the node's memory is lost under a running rank."""

import os
import shutil

import pytest
import torch

from deepspeed_ext.snapshot import SlotImage, SnapshotSlots


def _fill(slots, i, step, values):
    data = torch.tensor(values, dtype=torch.float32)
    nbytes = data.numel() * 4
    buf = slots.buffer(i, nbytes)
    buf.copy_(data.view(torch.uint8))
    meta = {"step": step, "entries": [{"key": "w", "dtype": "float32", "shape": [len(values)],
                                       "start": 0, "nbytes": nbytes}]}
    slots.publish(i, meta)
    return meta


def test_complete_snapshot_is_found_by_a_restarted_rank(tmp_path):
    meta = _fill(SnapshotSlots(str(tmp_path), 1), 0, 7, [1.0, 2.0, 3.0])
    again = SnapshotSlots(str(tmp_path), 1)  # a new process of the same rank
    assert again.complete() == [(0, meta)]
    image = SlotImage(again.image_path(0))
    assert image.read(meta["entries"][0]).tolist() == [1.0, 2.0, 3.0]
    image.close()


def test_read_into_copies_straight_into_the_target_and_leaves_the_snapshot_alone(tmp_path):
    """read_into converts into the target's dtype, refuses a target of another size, and
    neither it nor writing to what read returned changes the snapshot; the image then
    closes (no view of its map is left behind)."""
    slots = SnapshotSlots(str(tmp_path), 1)
    meta = _fill(slots, 0, 7, [1.5, -2.0, 3.25])
    entry = meta["entries"][0]
    image = SlotImage(slots.image_path(0))
    target = torch.zeros(3, dtype=torch.float64)
    image.read_into(entry, target)
    assert target.tolist() == [1.5, -2.0, 3.25]
    with pytest.raises(RuntimeError):
        image.read_into(entry, torch.zeros(4))
    first = image.read(entry)
    first.fill_(9.0)
    assert image.read(entry).tolist() == [1.5, -2.0, 3.25]
    image.close()
    again = SlotImage(slots.image_path(0))  # what another process would map
    assert again.read(entry).tolist() == [1.5, -2.0, 3.25]
    again.close()


def test_metadata_without_its_bytes_is_not_a_snapshot(tmp_path):
    slots = SnapshotSlots(str(tmp_path), 0)
    _fill(slots, 0, 3, [1.0] * 64)
    _fill(slots, 1, 4, [2.0] * 64)
    os.remove(slots.image_path(0))                      # image gone, metadata left
    with open(slots.image_path(1), "r+b") as f:         # image cut short
        f.truncate(16)
    assert SnapshotSlots(str(tmp_path), 0).complete() == []


def test_publish_after_the_node_memory_vanished_refuses(tmp_path):
    slots = SnapshotSlots(str(tmp_path), 0)
    _fill(slots, 0, 1, [1.0, 2.0])
    shutil.rmtree(tmp_path / "rank00000")               # the node's memory is wiped
    buf = slots.buffer(0, 8)                            # the old mapping is still writable
    buf.zero_()
    with pytest.raises(RuntimeError, match="vanished"):
        slots.publish(0, {"step": 2, "entries": []})
    assert not (tmp_path / "rank00000").exists()        # nothing re-created half-way


def test_a_wipe_between_the_check_and_the_write_does_not_recreate_the_directory(
        tmp_path, monkeypatch):
    """Another rank's lose-memory can wipe the node's memory right after publish's check:
    the write must fail, not recreate the directory with the umask's mode (0755), which
    made the restart refuse the node's memory as readable by other users."""
    slots = SnapshotSlots(str(tmp_path), 0)
    _fill(slots, 0, 1, [1.0, 2.0])
    shutil.rmtree(tmp_path / "rank00000")
    real_isdir, calls = os.path.isdir, []

    def isdir_stale_once(path):                          # the check saw it still there
        calls.append(path)
        return True if len(calls) == 1 else real_isdir(path)

    monkeypatch.setattr(os.path, "isdir", isdir_stale_once)
    with pytest.raises(RuntimeError, match="vanished"):
        slots.publish(1, {"step": 2, "entries": []})
    monkeypatch.undo()
    assert calls and not (tmp_path / "rank00000").exists()


def test_a_one_element_record_is_not_broadcast_into_a_larger_tensor(tmp_path):
    """``copy_`` broadcasts a one-element source: a record of one float read into a
    tensor of 4 filled it with that value instead of failing."""
    slots = SnapshotSlots(str(tmp_path), 0)
    meta = _fill(slots, 0, 3, [7.0])
    image = SlotImage(slots.image_path(0))
    with pytest.raises(RuntimeError, match="elements"):
        image.read_into(meta["entries"][0], torch.zeros(4))
    outside = dict(meta["entries"][0], start=1 << 20)
    with pytest.raises(RuntimeError, match="outside"):
        image.read_into(outside, torch.zeros(1))
    image.close()


def test_slots_of_another_run_are_no_snapshots_of_this_job(tmp_path):
    """A slot another job wrote (a shared --moc-shm-dir, or planted) is not this job's
    to recover from; it is free to be overwritten."""
    theirs = SnapshotSlots(str(tmp_path), 0, run_id="b" * 32)
    meta = _fill(theirs, 0, 9, [1.0, 2.0])
    meta["run_id"] = "b" * 32
    theirs.publish(0, meta)
    ours = SnapshotSlots(str(tmp_path), 0, run_id="a" * 32)
    assert ours.complete() == []
    assert SnapshotSlots(str(tmp_path), 0, run_id="b" * 32).complete() == [(0, meta)]


def test_a_flipped_bit_in_a_slot_is_found_before_recovery_uses_it(tmp_path):
    from deepspeed_ext.format import memsum
    slots = SnapshotSlots(str(tmp_path), 0)
    data = torch.arange(16, dtype=torch.float32)
    buf = slots.buffer(0, 64)
    buf.copy_(data.view(torch.uint8))
    meta = {"step": 5, "entries": [{"key": "w", "dtype": "float32", "shape": [16], "start": 0,
                                    "nbytes": 64}], "checksum": memsum.digest(buf)}
    slots.publish(0, meta)
    assert slots.verify(0) is None
    buf[17] ^= 1  # memory damaged after the snapshot
    assert "mismatch" in slots.verify(0)
    del meta["checksum"]
    slots.publish(0, meta)
    assert "no valid checksum" in slots.verify(0)  # unverifiable counts as damaged


def test_planted_links_in_a_rank_directory_are_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    node = tmp_path / "node"
    node.mkdir(mode=0o700)
    slots = SnapshotSlots(str(node), 0)
    os.symlink(victim, slots.image_path(1))
    with pytest.raises(OSError):
        slots.buffer(1, 64)
    os.symlink(victim, os.path.join(slots.dir, "slot2.json"))
    assert slots.meta(2) is None
    assert victim.read_bytes() == b"precious"


# -- slots prepared before training ---------------------------------------------------

def _recording_slots(tmp_path, slots=3):
    mapped, unmapped = [], []
    return SnapshotSlots(str(tmp_path), 0, slots=slots, on_map=mapped.append,
                         on_unmap=unmapped.append), mapped, unmapped


def test_prepare_maps_every_slot_once_and_later_buffers_make_no_system_call(
        tmp_path, monkeypatch):
    slots, mapped, unmapped = _recording_slots(tmp_path)
    seconds = slots.prepare(3 * 4096 + 5)
    assert seconds >= 0 and slots.prepared_bytes == 3 * 4096 + 5
    assert slots.maps_created == 3 and len(mapped) == 3 and not unmapped
    assert all(m.numel() >= 3 * 4096 + 5 for m in mapped)
    assert all(os.path.getsize(slots.image_path(i)) >= 3 * 4096 + 5 for i in range(3))

    calls = []

    def recorded(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call

    for name in ("open", "stat", "fstat", "lstat", "ftruncate", "posix_fallocate"):
        monkeypatch.setattr(os, name, recorded(name, getattr(os, name)))
    monkeypatch.setattr(torch, "from_file", recorded("from_file", torch.from_file))
    try:
        views = [(i, n, slots.buffer(i, n)) for i, n in
                 [(0, 1), (1, 4096), (2, 3 * 4096 + 5), (0, 3 * 4096 + 5), (1, 0)]]
    finally:
        monkeypatch.undo()
    assert calls == []                                        # nothing on the save path
    assert all(v.numel() == n for i, n, v in views)
    assert all(v.data_ptr() == mapped[i].data_ptr() for i, n, v in views if n)
    assert slots.maps_created == 3 and len(mapped) == 3 and slots.grown == 0


def test_a_snapshot_larger_than_prepared_grows_its_slot_counted_and_warned_once(
        tmp_path, caplog):
    slots, mapped, unmapped = _recording_slots(tmp_path)
    slots.prepare(4096)
    with caplog.at_level("WARNING", logger="deepspeed_ext.snapshot"):
        assert slots.buffer(0, 10000).numel() == 10000
        assert slots.buffer(0, 9000).numel() == 9000          # fits the grown mapping
        slots.buffer(1, 20000)
    assert slots.grown == 2 and slots.maps_created == 5
    assert [m.numel() for m in unmapped] == [4096, 4096]      # the old mappings dropped
    warnings = [r.getMessage() for r in caplog.records
                if "slot grew during training" in r.getMessage()]
    assert len(warnings) == 1 and "10000" in warnings[0] and "4096" in warnings[0]
    assert os.path.getsize(slots.image_path(1)) == 20000


def test_prepare_keeps_the_snapshots_already_in_the_slots(tmp_path):
    """A restarted process prepares its slots before recovering from them: the complete
    snapshot must still be complete, verify and read back the same."""
    from deepspeed_ext.format import memsum
    first = SnapshotSlots(str(tmp_path), 0)
    data = torch.arange(1000, dtype=torch.float32)
    buf = first.buffer(0, 4000)
    buf.copy_(data.view(torch.uint8))
    meta = {"step": 5, "entries": [{"key": "w", "dtype": "float32", "shape": [1000],
                                    "start": 0, "nbytes": 4000}],
            "checksum": memsum.digest(buf)}
    first.publish(0, meta, layout_id="w")
    first.prepare(1 << 16)                                    # the same process: remapped
    assert first.buffer(0, 4000).view(torch.float32).tolist() == data.tolist()
    again, mapped, _ = _recording_slots(tmp_path)             # a restarted process
    again.prepare(1 << 17)
    assert again.complete() == [(0, meta)] and again.verify(0) is None
    image = SlotImage(again.image_path(0))
    assert image.read(meta["entries"][0]).tolist() == data.tolist()
    image.close()
    assert os.path.getsize(again.image_path(0)) == 1 << 17 and len(mapped) == 3
    smaller = SnapshotSlots(str(tmp_path), 0)
    smaller.prepare(100)                                      # a larger file keeps its size
    assert os.path.getsize(smaller.image_path(0)) == 1 << 17
    assert smaller.verify(0) is None


def test_a_full_shared_memory_fails_prepare_naming_the_file(tmp_path, monkeypatch):
    import errno
    slots, mapped, _ = _recording_slots(tmp_path)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as err:
        slots.prepare(1 << 20)
    assert err.value.errno == errno.ENOSPC
    assert slots.image_path(0) in str(err.value) and str(1 << 20) in str(err.value)
    assert slots.maps_created == 0 and not mapped


def test_a_filesystem_without_fallocate_still_prepares(tmp_path, monkeypatch):
    import errno
    slots, mapped, _ = _recording_slots(tmp_path, slots=2)

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    slots.prepare(8192)
    assert slots.maps_created == 2 and [m.numel() for m in mapped] == [8192, 8192]
    assert all(os.path.getsize(slots.image_path(i)) == 8192 for i in range(2))


# -- the compact publish ----------------------------------------------------------------

def _big_meta(step, entries=648, specs=True):
    meta = {"step": step, "tag": f"global_step{step}", "signature": "s" * 16,
            "entries": [{"key": f"module.layers.{k}.weight", "dtype": "float32",
                         "shape": [4], "start": 16 * k, "nbytes": 16} for k in range(entries)],
            "experts": [0, 1], "objects_tree": {"engine": {"global_steps": step}},
            "checksum": "xxh3_64:" + "0" * 16, "run_id": None}
    if specs:
        meta["specs"] = {e["key"]: {"global_shape": [4, 8], "global_offset": [0, k],
                                    "replica_id": 0} for k, e in enumerate(meta["entries"])}
    return meta


def _with_image(slots, i, meta, layout_id=None):
    slots.buffer(i, 16 * len(meta["entries"]))
    slots.publish(i, meta, layout_id=layout_id)


def _layout_files(slots):
    return sorted(n for n in os.listdir(slots.dir) if n.startswith("layout-"))


def test_a_compact_publish_is_small_written_once_per_layout_and_reads_back(tmp_path):
    slots = SnapshotSlots(str(tmp_path), 0)
    first, second = _big_meta(3), _big_meta(4)
    _with_image(slots, 0, first, "zero2-0")
    assert os.path.getsize(slots._path(0, "json")) < 4096
    [name] = _layout_files(slots)
    before = os.stat(os.path.join(slots.dir, name))
    _with_image(slots, 1, second, "zero2-0")
    after = os.stat(os.path.join(slots.dir, name))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert slots.layouts.writes == 1 and _layout_files(slots) == [name]
    assert slots.meta(1) is second                            # the full dict in memory
    text = open(slots._path(1, "json")).read()
    assert "\n" not in text and '"layout":"zero2-0"' in text and "entries" not in text
    again = SnapshotSlots(str(tmp_path), 0)                   # a restarted process
    assert again.complete() == [(0, first), (1, second)]
    assert again.meta(0)["entries"] == first["entries"]
    assert again.meta(1)["specs"] == second["specs"]


def test_a_publish_without_layout_id_is_compact_and_inline(tmp_path):
    slots = SnapshotSlots(str(tmp_path), 0)
    meta = _big_meta(2, entries=3)
    _with_image(slots, 0, meta)
    data = open(slots._path(0, "json"), "rb").read()
    assert b"\n" not in data and b", " not in data and b'"entries":[' in data
    assert _layout_files(slots) == []
    assert SnapshotSlots(str(tmp_path), 0).meta(0) == meta


def test_an_old_indented_slot_file_with_inline_entries_still_reads(tmp_path):
    from deepspeed_ext.format.storage import atomic_write_json
    slots = SnapshotSlots(str(tmp_path), 0)
    meta = _big_meta(6, entries=5)
    slots.buffer(0, 80)
    atomic_write_json(slots._path(0, "json"), meta)           # what the old code wrote
    assert b"\n " in open(slots._path(0, "json"), "rb").read()
    assert SnapshotSlots(str(tmp_path), 0).complete() == [(0, meta)]


@pytest.mark.parametrize("damage", ["byte", "missing", "sha", "both"])
def test_a_damaged_layout_reference_is_no_snapshot(tmp_path, damage):
    import json
    slots = SnapshotSlots(str(tmp_path), 0)
    _with_image(slots, 0, _big_meta(3, entries=8), "L")
    [name] = _layout_files(slots)
    path, slot_json = os.path.join(slots.dir, name), slots._path(0, "json")
    if damage == "byte":
        data = bytearray(open(path, "rb").read())
        data[data.index(b"float32")] = ord("F")               # still JSON, still a layout
        open(path, "wb").write(bytes(data))
    elif damage == "missing":
        os.remove(path)
    else:
        record = json.load(open(slot_json))
        if damage == "sha":
            record["layout_sha256"] = "0" * 64
        else:
            record["entries"] = []                             # inline and by reference
        open(slot_json, "w").write(json.dumps(record))
    assert SnapshotSlots(str(tmp_path), 0).meta(0) is None


@pytest.mark.parametrize("bad", ["a/b", "..", "../x", "", "a.b", "x" * 65, 7])
def test_a_layout_id_that_could_leave_the_rank_directory_is_refused(tmp_path, bad):
    slots = SnapshotSlots(str(tmp_path), 0)
    with pytest.raises(ValueError):
        _with_image(slots, 0, _big_meta(1, entries=2), bad)
    assert not os.path.exists(slots._path(0, "json")) and _layout_files(slots) == []


def test_reserved_keys_are_refused(tmp_path):
    slots = SnapshotSlots(str(tmp_path), 0)
    with pytest.raises(ValueError):
        slots.publish(0, dict(_big_meta(1, entries=1), layout="x"))


def test_unreferenced_layout_files_are_removed_and_referenced_ones_kept(tmp_path):
    slots = SnapshotSlots(str(tmp_path), 0)
    a, b, c = _big_meta(1, entries=2), _big_meta(2, entries=3), _big_meta(3, entries=4)
    _with_image(slots, 0, a, "A")
    _with_image(slots, 1, b, "B")
    assert len(_layout_files(slots)) == 2
    stray = os.path.join(slots.dir, "layout-Z-" + "0" * 16 + ".json.tmp.999999999")
    open(stray, "w").write("{")                               # a killed writer's temp file
    slots.invalidate(0)
    _with_image(slots, 0, c, "C")                             # nothing names A any more
    assert [n.split("-")[1] for n in _layout_files(slots)] == ["B", "C"]
    assert os.path.exists(slots.image_path(0)) and os.path.exists(slots._path(1, "json"))
    a2 = dict(a, step=4)
    _with_image(slots, 2, a2, "A")                            # A is written again
    assert [n.split("-")[1] for n in _layout_files(slots)] == ["A", "B", "C"]
    again = SnapshotSlots(str(tmp_path), 0)
    assert again.complete() == [(1, b), (0, c), (2, a2)]
    again.invalidate(1)                                       # a restarted process
    _with_image(again, 1, _big_meta(5, entries=5), "D")       # drops B, keeps A and C
    assert [n.split("-")[1] for n in _layout_files(again)] == ["A", "C", "D"]
    assert [m["step"] for _, m in SnapshotSlots(str(tmp_path), 0).complete()] == [3, 4, 5]


def test_a_layout_id_reused_for_other_entries_never_breaks_an_older_slot(tmp_path):
    """The same id with other entries (a caller's mistake, or a restarted process
    numbering its layouts from zero again) is a new file: the older slot keeps its own."""
    slots = SnapshotSlots(str(tmp_path), 0)
    first = _big_meta(1, entries=4)
    _with_image(slots, 0, first, "0")
    expected_first = [dict(e) for e in first["entries"]]
    second = _big_meta(2, entries=4)                          # equal but other objects,
    second["entries"][0]["dtype"] = "bfloat16"                # then one entry differs
    _with_image(slots, 1, second, "0")
    restarted = SnapshotSlots(str(tmp_path), 0)
    third = _big_meta(3, entries=6)
    _with_image(restarted, 2, third, "0")
    final = SnapshotSlots(str(tmp_path), 0)
    assert final.meta(0)["entries"] == expected_first
    assert final.meta(1)["entries"][0]["dtype"] == "bfloat16"
    assert final.meta(2)["entries"] == third["entries"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm")
def test_the_first_snapshot_into_a_prepared_slot_takes_no_page_faults():
    """prepare touches every page: the first copy into a slot (inside training) must not
    fault once per 4 KiB (on tmpfs, where slots live)."""
    import resource
    import tempfile
    with tempfile.TemporaryDirectory(dir="/dev/shm") as node:
        os.chmod(node, 0o700)
        slots = SnapshotSlots(node, 0, slots=1)
        slots.prepare(8 << 20)                                # 2048 pages
        buf = slots.buffer(0, 8 << 20)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buf.fill_(7)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 256, faults
        assert int(buf.min()) == 7
        del buf, slots


def test_with_every_other_slot_being_persisted_a_snapshot_waits_for_the_keeper(tmp_path):
    """Slot 2 holds the newest snapshot, slots 0 and 1 are being persisted (right after an
    in-job restart, the failed run's persist and the new run's first one): choose raises,
    choose_waiting waits until the keeper removes a mark and returns that slot, and gives
    up with choose's error once its time is out."""
    import threading
    import time
    from deepspeed_ext.snapshot import choose_waiting
    slots = SnapshotSlots(str(tmp_path), 0)
    for i, step in ((0, 3), (1, 4), (2, 5)):
        _fill(slots, i, step, [float(step)])
    markers = [slots.persist_marker(0), slots.persist_marker(1)]
    with pytest.raises(RuntimeError, match="no free snapshot slot"):
        slots.choose()
    with pytest.raises(RuntimeError, match="no free snapshot slot"):
        choose_waiting(slots, timeout_s=0.05)
    keeper = threading.Timer(0.2, os.remove, args=(markers[1],))  # the keeper read slot 1
    keeper.start()
    start = time.monotonic()
    slot, waited = choose_waiting(slots, timeout_s=10.0)
    keeper.join()
    assert slot == 1 and 0.15 < waited < 5.0 and time.monotonic() - start >= waited
