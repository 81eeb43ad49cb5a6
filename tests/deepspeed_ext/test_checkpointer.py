"""MoC save/load on real multi-rank DeepSpeed engines (gloo): exact round trip, PEC,
resharding across world size, expert-parallel size and ZeRO stage."""

import json
import os

import pytest

from deepspeed_ext.format.naming import ITERATION_FILE
from tests.launch import describe, run_ranks
from tests.precision import skip_without

WORKER = "tests/deepspeed_ext/engine_worker.py"


def _run(tmp_path, name, nproc, action, flags):
    out = tmp_path / name
    out.mkdir()
    results = run_ranks(nproc, [action, str(out)] + flags, script=WORKER, timeout=300)
    assert all(r.returncode == 0 for r in results), describe(results)
    return [json.load(open(out / f"rank{r}.json")) for r in range(nproc)]


def _layout(nproc, ep, zero):
    return ["--moe-expert-parallel-size", str(ep), "--zero-stage", str(zero),
            "--global-batch-size", str(2 * 4)]


def test_round_trip_with_all_experts_is_bitwise_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = _layout(2, 2, 2)
    whole = _run(tmp_path, "whole", 2, "train-save", flags + ["--train-iters", "6"])
    _run(tmp_path, "first", 2, "train-save", flags + ["--train-iters", "3", "--save", ckpt,
                                                     "--save-interval", "3"])
    second = _run(tmp_path, "second", 2, "load-train-save", flags + ["--train-iters", "6",
                                                                   "--load", ckpt])
    assert second[0]["loaded"].endswith("global_step3")
    assert second[0]["client_state"] == {"step": 3}
    for r in range(2):
        assert second[r]["losses"] == whole[r]["losses"][3:]
    assert second[0]["final_state"] == whole[0]["final_state"]
    # Another model (narrower experts) is refused on every rank, naming the shapes:
    # reads by element range would otherwise load the saved tensors' first elements.
    out = tmp_path / "narrow"
    out.mkdir()
    narrow = run_ranks(2, ["load-train-save", str(out)] + flags + [
        "--train-iters", "6", "--load", ckpt, "--ffn-hidden-size", "64"], script=WORKER,
        timeout=300)
    for r in narrow:
        assert r.returncode != 0 and "was saved with shape [128, 32], this model's is [64, 32]" \
            in r.output, describe(narrow)


@pytest.mark.parametrize("scope", ["wo", "w", "o"])
def test_pec_restores_each_expert_from_its_newest_version(tmp_path, scope):
    """PEC K=1 and each of the paper's variants (``--moc-pec-scope``): every expert
    tensor loads from the checkpoint its part's index entry names, bitwise."""
    ckpt = str(tmp_path / "ckpt")
    flags = _layout(2, 2, 2) + ["--moc-pec-k", "1", "--moc-pec-scope", scope]
    first = _run(tmp_path, "first", 2, "train-save", flags + [
        "--train-iters", "3", "--save", ckpt, "--save-interval", "1"])
    saved = {int(k): v for k, v in first[0]["saved_states"].items()}
    manifest = json.load(open(os.path.join(ckpt, "global_step3", "manifest.json")))
    index = manifest["expert_index"]
    loaded = _run(tmp_path, "second", 2, "load-train-save", flags + [
        "--train-iters", "3", "--load", ckpt])[0]["state_after_load"]
    older = {"w": 0, "o": 0}
    for key, values in loaded.items():
        name, kind = key.split("|")[:2]
        if ".deepspeed_experts." not in name:
            assert values == saved[3][key], key
            continue
        expert = int(name.split(".deepspeed_experts.")[1].split(".")[0])
        entry = index[f"0/{expert}"]
        part = "w" if kind == "fp32" else "o"
        step = (entry.get("optim") or entry)["step"] if part == "o" else entry["step"]
        older[part] += step < 3
        assert values == saved[step][key], (key, step)
    # Exactly the parts the scope leaves out came from older checkpoints.
    assert (older["w"] > 0) == (scope in ("wo", "w")), older
    assert (older["o"] > 0) == (scope in ("wo", "o")), older


def test_pec_saves_after_resuming_from_another_spelling_or_directory(tmp_path):
    """PEC K=1, resumed with ``--save`` spelled differently from ``--load`` (a trailing
    slash), then into another directory: the expert index must extend the loaded
    checkpoint in the first case, and hold every expert in the second (an index names
    only its own directory's checkpoints). Each save failed before ("saved in no
    checkpoint"), and so did every later one."""
    from deepspeed_ext.format.manifest import read_manifest
    from deepspeed_ext.store.verify import verify_checkpoint
    ckpt, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    flags = _layout(2, 2, 2) + ["--moc-pec-k", "1"]
    _run(tmp_path, "first", 2, "train-save", flags + [
        "--train-iters", "3", "--save", ckpt, "--save-interval", "1"])
    _run(tmp_path, "slash", 2, "load-train-save", flags + [
        "--train-iters", "4", "--load", ckpt, "--save", ckpt + "/", "--save-interval", "1"])
    fourth = read_manifest(os.path.join(ckpt, "global_step4"))
    assert len(fourth.held_experts()) == 1  # K=1: the index extends global_step3
    assert {v.step for v in fourth.expert_versions().values()} > {4}
    assert verify_checkpoint(ckpt, "global_step4") == []
    _run(tmp_path, "moved", 2, "load-train-save", flags + [
        "--train-iters", "6", "--load", ckpt, "--save", other, "--save-interval", "1"])
    fifth, sixth = (read_manifest(os.path.join(other, f"global_step{s}")) for s in (5, 6))
    assert len(fifth.held_experts()) == 4 and len(sixth.held_experts()) == 1
    assert verify_checkpoint(other, "global_step6") == []


def test_a_reload_in_the_same_process_starts_a_new_timeline(tmp_path):
    """A library user (or a benchmark) reloads an older step and saves its steps again:
    the first timeline's later checkpoints are set aside and ``latest`` follows the new
    one. Before, saving global_step3 again was refused as "a complete checkpoint"."""
    from deepspeed_ext.format.manifest import read_manifest
    from deepspeed_ext.store.latest import read_latest
    from deepspeed_ext.store.verify import verify_checkpoint
    ckpt = tmp_path / "ckpt"
    result = _run(tmp_path, "run", 2, "save-reload-resave", _layout(2, 2, 2) + [
        "--save", str(ckpt), "--save-interval", "1"])
    assert result[0]["reloaded"] == {"step": 2}
    assert read_latest(str(ckpt)) == "global_step4"
    assert verify_checkpoint(str(ckpt), "global_step4") == []
    aside = sorted(n.split(".")[2] for n in os.listdir(ckpt) if n.startswith(".moc-set-aside."))
    assert aside == ["global_step3", "global_step4"]
    first = read_manifest(str(ckpt / "global_step2")).extra["attempt_started"]
    assert read_manifest(str(ckpt / "global_step4")).extra["attempt_started"] > first


@pytest.mark.parametrize("save_layout, load_layout, precision", [
    ((4, 4, 2), (2, 2, 2), []),
    ((4, 2, 2), (4, 4, 2), []),
    ((2, 2, 2), (2, 2, 1), []),
    ((2, 2, 2), (4, 4, 1), ["--bf16"]),  # fp32 master in ZeRO partitions, bf16 compute
    ((2, 2, 0), (2, 2, 2), []),          # no ZeRO (replicated state) -> ZeRO-2
])
def test_reshard_load(tmp_path, save_layout, load_layout, precision):
    if "--bf16" in precision:
        skip_without("bf16", "the fp32 cases check resharding")
    ckpt = str(tmp_path / "ckpt")
    first = _run(tmp_path, "first", save_layout[0], "train-save", _layout(*save_layout) + precision + [
        "--train-iters", "2", "--save", ckpt, "--save-interval", "2"])
    second = _run(tmp_path, "second", load_layout[0], "load-train-save",
                  _layout(*load_layout) + precision + ["--train-iters", "3", "--load", ckpt])
    before = first[0]["saved_states"]["2"]
    after = second[0]["state_after_load"]
    assert before.keys() == after.keys()
    different = [k for k in before if before[k] != after[k]]
    assert not different, different[:5]


def _consolidated(ckpt, tag, out):
    from safetensors.torch import load_file
    from deepspeed_ext.cli import main as moc_ckpt
    assert moc_ckpt(["consolidate", str(ckpt), "--tag", tag, "--out", str(out), "--optimizer"]) == 0
    return load_file(str(out))


def test_reshard_resave_consolidates_bitwise_equal(tmp_path):
    """Save on (world 4, EP 4), load on (world 2, EP 2, ZeRO 1), re-save: same model."""
    import torch
    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "first", 4, "train-save", _layout(4, 4, 2) + [
        "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2"])
    _run(tmp_path, "second", 2, "load-resave", _layout(2, 2, 1) + [
        "--train-iters", "2", "--load", str(ckpt), "--save", str(ckpt)])
    before = _consolidated(ckpt, "global_step2", tmp_path / "a.safetensors")
    after = _consolidated(ckpt, "resaved", tmp_path / "b.safetensors")
    assert before.keys() == after.keys() and any(".exp_avg" in k for k in before)
    assert any(".deepspeed_experts.3." in k for k in before)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_failure_on_one_rank_is_raised_everywhere_and_keeps_latest(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "out"
    out.mkdir()
    args = ["train-save", str(out)] + _layout(2, 2, 2) + [
        "--train-iters", "4", "--save", str(ckpt), "--save-interval", "2"]
    results = run_ranks(2, args, script=WORKER, timeout=300,
                        env={"MOC_TEST_FAIL_RANK": "1", "MOC_TEST_FAIL_STEP": "4"})
    for r in results:
        assert r.returncode != 0, describe(results)
        assert "MoC save of" in r.output and "rank 1: OSError" in r.output, describe(results)
    assert (ckpt / "latest").read_text().strip() == "global_step2"
    assert not (ckpt / "global_step4" / "manifest.json").exists()
    from deepspeed_ext.cli import main as moc_ckpt
    assert moc_ckpt(["verify", str(ckpt)]) == 0


@pytest.mark.parametrize("failing", ["objects", "moments"])
def test_a_load_failing_on_one_rank_is_raised_everywhere(tmp_path, failing):
    # Rank 1 fails where only it can (restoring the optimizer's scalars; creating the
    # moments in a fresh engine): every rank must raise the same MoC error, none be left
    # in the load's collectives (with gloo: "connection closed by peer" on rank 0).
    ckpt = str(tmp_path / "ckpt")
    flags = _layout(2, 2, 2)
    _run(tmp_path, "first", 2, "train-save", flags + ["--train-iters", "2", "--save", ckpt,
                                                     "--save-interval", "2"])
    out = tmp_path / "second"
    out.mkdir()
    env = ({"MOC_TEST_FAIL_RESTORE_RANK": "1"} if failing == "objects"
           else {"MOC_TEST_FAIL_MOMENTS_RANK": "1"})
    results = run_ranks(2, ["load-train-save", str(out)] + flags + [
        "--train-iters", "4", "--load", ckpt], script=WORKER, timeout=300, env=env)
    why = "rank 1: ValueError" if failing == "objects" else "rank 1: MemoryError"
    for r in results:
        assert r.returncode != 0, describe(results)
        assert "MoC load of" in r.output and why in r.output, describe(results)


def test_each_rank_checksums_only_the_files_it_reads(tmp_path):
    # One rank hashing every file of the checkpoint while the others wait grows with the
    # world size; each rank verifies what it reads instead. The manifests are read by
    # rank 0 alone, which sends the resolution (not every rank reading every manifest).
    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "first", 4, "train-save", _layout(4, 4, 2) + [
        "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2"])
    loads = _run(tmp_path, "second", 4, "load-train-save", _layout(4, 4, 2) + [
        "--train-iters", "2", "--load", str(ckpt)])
    hashed = [r["hashed_by_load"] for r in loads]
    files = {f"global_step2/{name}" for name in os.listdir(ckpt / "global_step2")
             if name.endswith((".safetensors", ".json")) and name != "manifest.json"}
    assert set().union(*hashed) == files, hashed  # every file is checked by a reader
    for rank, mine in enumerate(hashed):
        assert len(mine) == len(set(mine)), hashed  # each file once per rank
    # The write plan spreads a rank's partition over a few files, not all of them: rank
    # 0 (which used to hash the whole checkpoint while choosing it) checks only those.
    assert set(hashed[0]) < files, hashed
    # Every rank reads its RNG state from the objects' own small file, not from rank 0's
    # share (which every rank then checksummed whole: a checkpoint's worth of extra reads
    # aimed at one file).
    assert all("global_step2/objects.safetensors" in mine for mine in hashed), hashed
    assert not all("global_step2/rank00000.safetensors" in mine for mine in hashed), hashed
    read = [r["manifests_read_by_load"] for r in loads]
    assert "global_step2" in read[0] and not any(read[1:]), read


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_file_is_detected_and_load_falls_back(tmp_path, damage, capsys):
    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "first", 2, "train-save", _layout(2, 2, 2) + [
        "--train-iters", "4", "--save", str(ckpt), "--save-interval", "2"])
    victim = ckpt / "global_step4" / "rank00001.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    from deepspeed_ext.cli import main as moc_ckpt
    assert moc_ckpt(["verify", str(ckpt)]) == 1
    assert "rank00001.safetensors" in capsys.readouterr().out

    out = tmp_path / "second"
    out.mkdir()
    results = run_ranks(2, ["load-train-save", str(out)] + _layout(2, 2, 2) + [
        "--train-iters", "4", "--load", str(ckpt)], script=WORKER, timeout=300)
    assert all(r.returncode == 0 for r in results), describe(results)
    assert "skipped checkpoint global_step4" in results[0].output
    assert "rank00001.safetensors" in results[0].output
    assert json.load(open(out / "rank0.json"))["loaded"].endswith("global_step2")


def test_resuming_past_a_damaged_checkpoint_saves_its_step_again(tmp_path):
    # The newest checkpoint (4) is damaged, the load falls back to 2, and the run saves
    # into the same directory: its save of step 4 must not collide with the damaged one,
    # which is set aside (kept for a human, out of MoC's sight), not deleted.
    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "first", 2, "train-save", _layout(2, 2, 2) + [
        "--train-iters", "4", "--save", str(ckpt), "--save-interval", "2"])
    victim = ckpt / "global_step4" / "rank00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    out = tmp_path / "second"
    out.mkdir()
    results = run_ranks(2, ["load-train-save", str(out)] + _layout(2, 2, 2) + [
        "--train-iters", "6", "--load", str(ckpt), "--save", str(ckpt),
        "--save-interval", "2"], script=WORKER, timeout=300)
    assert all(r.returncode == 0 for r in results), describe(results)
    assert json.load(open(out / "rank0.json"))["loaded"].endswith("global_step2")
    assert "set aside checkpoint(s) global_step4" in results[0].output
    aside = [n for n in os.listdir(ckpt) if n.startswith(".moc-set-aside.global_step4.")]
    assert len(aside) == 1 and (ckpt / aside[0] / "rank00001.safetensors").read_bytes() == data
    assert (ckpt / "latest").read_text().strip() == "global_step6"
    from deepspeed_ext.cli import main as moc_ckpt
    assert moc_ckpt(["verify", str(ckpt)]) == 0  # 2, the new 4 and 6: all sound


def test_save_and_load_through_an_fsspec_url(tmp_path):
    """``--save file://...`` goes through fsspec (as ``s3://`` would): asynchronous saves,
    retention and the load are bitwise the same as with a local directory."""
    from deepspeed_ext import cli
    local = tmp_path / "ckpt"
    url = "file://" + str(local)
    flags = _layout(2, 2, 2) + ["--moc-checkpoint", "--moc-keep", "2"]
    first = _run(tmp_path, "first", 2, "train-save", flags + [
        "--train-iters", "3", "--save", url, "--save-interval", "1"])
    assert sorted(os.listdir(local)) == ["global_step2", "global_step3", "latest", ITERATION_FILE]
    assert (local / ITERATION_FILE).read_text().strip() == "3"  # follows latest
    assert cli.main(["verify", url]) == 0
    second = _run(tmp_path, "second", 2, "load-train-save", flags + [
        "--train-iters", "3", "--load", url])
    assert second[0]["loaded"] == url + "/global_step3"
    assert second[0]["client_state"] == {"step": 3}
    after, saved = second[0]["state_after_load"], first[0]["saved_states"]["3"]
    assert after.keys() == saved.keys()
    assert [k for k in after if after[k] != saved[k]] == []
