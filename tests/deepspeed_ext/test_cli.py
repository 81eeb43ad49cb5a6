"""``moc-ckpt`` inspect / verify / consolidate (deepspeed_ext.cli)."""

import os
import sys

import pytest
import torch
from safetensors import safe_open

from deepspeed_ext import cli
from tests.deepspeed_ext.test_manifest import (KINDS, expert_param, flip_last_byte, rank_file,
                                               no_fsync, three_checkpoints, value)

assert no_fsync  # autouse fixture, imported to apply here too


@pytest.fixture
def ckpt_dir(tmp_path):
    run = three_checkpoints(tmp_path / "ckpt")
    return str(tmp_path / "ckpt"), run


def test_inspect_all(ckpt_dir, capsys):
    path, _ = ckpt_dir
    os.mkdir(os.path.join(path, "global_step40"))  # a save in progress
    os.mkdir(os.path.join(path, ".moc-set-aside.global_step50.123"))
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "3 complete checkpoints, latest: global_step30" in out
    assert "incomplete (no manifest.json): global_step40" in out
    assert "set aside (an earlier attempt's abandoned timeline" in out
    assert ".moc-set-aside.global_step50.123" in out
    assert "global_step20  step 20  world size 3" in out
    assert "experts saved here (step 20): layer 0: 1 | layer 1: 3" in out
    assert "experts saved here (step 10): layer 0: 0 1 2 3 | layer 1: 0 1 2 3" in out
    assert "bytes per rank: max" in out and "num_experts=4" in out
    # ages at step 30: layer 0 -> 20 10 0 20, layer 1 -> 20 20 20 0
    lines = out.splitlines()
    header = lines.index(next(l for l in lines if l.startswith("expert ages at global_step30")))
    assert lines[header + 2].split() == ["0", "20", "10", "0", "20"]
    assert lines[header + 3].split() == ["1", "20", "20", "20", "0"]


def test_inspect_one_tag(ckpt_dir, capsys):
    path, _ = ckpt_dir
    assert cli.main(["inspect", path, "--tag", "global_step20"]) == 0
    out = capsys.readouterr().out
    assert "global_step20  step 20" in out and "global_step30" not in out
    assert "expert ages at global_step20 (step 20)" in out


def test_verify_exit_codes(ckpt_dir, capsys):
    path, _ = ckpt_dir
    assert cli.main(["verify", path]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 3
    bad = rank_file(path, "global_step20", 2)
    flip_last_byte(bad)
    assert cli.main(["verify", path, "--no-checksums"]) == 0
    capsys.readouterr()
    assert cli.main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert "FAILED global_step20" in out and bad in out
    assert "OK     global_step10" in out
    assert cli.main(["verify", path, "--tag", "global_step10"]) == 0


def test_verify_reports_latest_naming_a_missing_checkpoint(ckpt_dir, capsys):
    path, _ = ckpt_dir
    with open(os.path.join(path, "latest"), "w") as f:
        f.write("global_step99")
    assert cli.main(["verify", path]) == 1
    assert "global_step99" in capsys.readouterr().out


def test_bad_input_exits_2(ckpt_dir, tmp_path, capsys):
    path, _ = ckpt_dir
    cases = [["verify", str(tmp_path / "nope")],
             ["verify", path, "--tag", "global_step99"],
             ["inspect", str(tmp_path / "nope")],
             ["verify", str(tmp_path)],  # a directory with no checkpoint
             ["consolidate", path, "--out", str(tmp_path / "model.bin")],
             ["consolidate", path, "--out", str(tmp_path / "no" / "dir" / "m.safetensors")],
             ["consolidate", str(tmp_path / "empty_but_missing"), "--out",
              str(tmp_path / "m.safetensors")]]
    for argv in cases:
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err.startswith("error: "), argv
    assert cli.main(["frobnicate"]) == 2
    assert cli.main([]) == 2


def test_consolidate_newest_versions(ckpt_dir, tmp_path, capsys):
    path, run = ckpt_dir
    out = str(tmp_path / "model.safetensors")
    assert cli.main(["consolidate", path, "--out", out]) == 0
    assert "from global_step30 (step 30)" in capsys.readouterr().out
    expected = {name: t for (name, kind), t in run.truth.items() if kind == "fp32"}
    with safe_open(out, framework="pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        assert f.metadata()["tag"] == "global_step30"
        for name, tensor in expected.items():
            assert torch.equal(f.get_tensor(name), tensor), name


def test_consolidate_with_optimizer_and_fallback(ckpt_dir, tmp_path, capsys):
    path, run = ckpt_dir
    flip_last_byte(rank_file(path, "global_step30", 1))
    out = str(tmp_path / "model.safetensors")
    assert cli.main(["consolidate", path, "--out", out, "--optimizer"]) == 0
    captured = capsys.readouterr()
    assert "warning: skipped checkpoint global_step30" in captured.err
    assert "from global_step20 (step 20)" in captured.out
    with safe_open(out, framework="pt") as f:
        keys = set(f.keys())
        names = {name for name, _ in run.truth}
        assert keys == names | {f"{n}.{k}" for n in names for k in KINDS if k != "fp32"}
        # the step-20 state: expert 0/2 from step 10 (its step-30 save is skipped)
        name = expert_param(0, 2, "w1")
        assert torch.equal(f.get_tensor(f"{name}.exp_avg_sq"),
                           value(name, "exp_avg_sq", 10, (3, 5)))
        name = expert_param(1, 3, "b1")
        assert torch.equal(f.get_tensor(name), value(name, "fp32", 20, (4,)))
    # the corrupt checkpoint named explicitly: a checkpoint problem, exit 1
    assert cli.main(["consolidate", path, "--tag", "global_step30", "--out", out]) == 1
    assert "checksum" in capsys.readouterr().err


def test_main_cli_exits_with_status(ckpt_dir, monkeypatch):
    path, _ = ckpt_dir
    monkeypatch.setattr(sys, "argv", ["moc-ckpt", "verify", path])
    with pytest.raises(SystemExit) as exit_:
        cli.main_cli()
    assert exit_.value.code == 0


def test_densify_finds_the_window_behind_a_frame_rank_0_has_not_written(tmp_path, capsys):
    """After a crash the newest frame on storage often holds only other ranks' markers
    (rank 0's keeper had not copied it yet): densify must still find the complete window
    behind it, and replay it with memory of its own, never the run's --moc-shm-dir."""
    import json
    from deepspeed_ext import exact as ex
    save = tmp_path / "ckpt"

    def mark(frame, rank):
        os.makedirs(ex.frame_dir(str(save), frame), exist_ok=True)
        record = {"window_start": 0, "window": 3, "groups": [["a"], ["b"], ["c"]],
                  "world_size": 2, "layout": {}, "cwd": str(tmp_path),
                  "command": ["pretrain_gpt_moe.py", "--moc-shm-dir", "/dev/shm/the-runs-own"]}
        with open(os.path.join(ex.frame_dir(str(save), frame), f"rank{rank:05d}.json"), "w") as f:
            json.dump(record, f)
    for frame in range(3):
        mark(frame, 0), mark(frame, 1)
    mark(3, 1)  # the newest frame: rank 1's marker only
    assert cli.main(["densify", str(save), "--out", str(tmp_path / "dense"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "replaying iterations 1..3" in out, out
    command = out.split("\n  ", 1)[1].split()
    shm = command[len(command) - 1 - command[::-1].index("--moc-shm-dir") + 1]
    assert shm != "/dev/shm/the-runs-own" and "moc-densify-" in shm  # the last one wins
    assert not os.path.exists(shm)  # removed again
