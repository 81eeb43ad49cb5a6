"""Boundaries of :mod:`deepspeed_ext.store.verify` found by mutation testing
(``bash scripts/mutation.sh deepspeed_ext/store``)."""

from safetensors.torch import load_file

from deepspeed_ext.format.objects import TENSOR_PREFIX
from deepspeed_ext.format.storage import write_fragment_file
from deepspeed_ext.store.catalog import resolve_checkpoint
from deepspeed_ext.store.verify import verify_checkpoint, verify_resolution
from tests.deepspeed_ext.commit_helpers import commit_two_ranks
from tests.deepspeed_ext.format.test_manifest import FakeRun, edit_manifest


def test_verifying_a_resolution_checks_the_checksums_by_default(tmp_path):
    commit_two_ranks(str(tmp_path), "global_step10", 10, 1.0)
    res = resolve_checkpoint(str(tmp_path), "global_step10")
    assert verify_resolution(str(tmp_path), res) == []
    path = tmp_path / "global_step10" / "rank00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF   # same size, one bit flipped in the tensor's bytes
    path.write_bytes(bytes(data))
    assert verify_resolution(str(tmp_path), res, checksums=False) == []
    problems = verify_resolution(str(tmp_path), res)
    assert any("rank00001.safetensors" in p for p in problems), problems


def _first_fragment(data):
    tkey = sorted(data["tensors"])[0]
    return tkey, data["tensors"][tkey]


def test_a_fragment_stored_longer_or_of_another_dtype_than_recorded_is_a_problem(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 1)
    seen = {}

    def shorten(data):   # the stored fragment has one element more than recorded
        tkey, entry = _first_fragment(data)
        frag = entry["fragments"][0]
        frag["length"] -= 1
        seen.update(key=frag["key"], length=frag["length"])
    edit_manifest(tmp_path, "global_step10", shorten)
    problems = verify_checkpoint(str(tmp_path), "global_step10", checksums=False)
    assert any(f"fragment {seen['key']!r} is torch.float32 [{seen['length'] + 1}], manifest "
               f"records float32 [{seen['length']}]" in p for p in problems), problems
    for other in ("bfloat16", "int32"):   # sorting before and after float32
        run.save(f"global_step1{other[0]}", 11, 1)

        def retype(data, other=other):
            data["tensors"][_first_fragment(data)[0]]["dtype"] = other
        edit_manifest(tmp_path, f"global_step1{other[0]}", retype)
        problems = verify_checkpoint(str(tmp_path), f"global_step1{other[0]}", checksums=False)
        assert any(f"manifest records {other} [" in p for p in problems), (other, problems)


def test_a_damaged_file_of_an_older_checkpoint_holding_an_expert_is_found(tmp_path):
    run = FakeRun(tmp_path)
    run.save("global_step10", 10, 2)
    run.save("global_step20", 20, 2, [(0, 1)])   # the other experts stay at step 10
    path = tmp_path / "global_step10" / "rank00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = verify_checkpoint(str(tmp_path), "global_step20")
    assert any("global_step10" in p and "rank00001.safetensors" in p for p in problems), problems


def test_a_fragment_in_a_file_the_manifest_does_not_list_is_a_problem_not_a_crash(tmp_path):
    FakeRun(tmp_path).save("global_step10", 10, 1)

    def elsewhere(data):
        _first_fragment(data)[1]["fragments"][0]["file"] = "rank00009.safetensors"
    edit_manifest(tmp_path, "global_step10", elsewhere)
    problems = verify_checkpoint(str(tmp_path), "global_step10", checksums=False)
    assert any("not among the checkpoint's files" in p for p in problems), problems


def test_objects_tensors_missing_from_a_sound_file_are_a_problem(tmp_path):
    FakeRun(tmp_path).save("global_step10", 10, 1)
    path = str(tmp_path / "global_step10" / "rank00000.safetensors")
    tensors = load_file(path)
    objects_keys = [k for k in tensors if k.startswith(TENSOR_PREFIX)]
    assert objects_keys
    record = write_fragment_file(path, {k: v for k, v in tensors.items()
                                        if k != objects_keys[0]})

    def rerecord(data):
        data["files"]["rank00000.safetensors"].update(nbytes=record.nbytes, sha256=record.sha256)
    edit_manifest(tmp_path, "global_step10", rerecord)
    problems = verify_checkpoint(str(tmp_path), "global_step10")
    assert problems == [f"{path}: lacks tensor {objects_keys[0]!r} of objects.json"]


def test_an_unreadable_file_holding_the_objects_tensors_is_a_problem_not_a_crash(tmp_path):
    FakeRun(tmp_path).save("global_step10", 10, 1)
    path = tmp_path / "global_step10" / "rank00000.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")   # a header length past the file
    path.write_bytes(bytes(data))
    problems = verify_checkpoint(str(tmp_path), "global_step10", checksums=False)
    assert problems and all("rank00000.safetensors" in p for p in problems), problems
