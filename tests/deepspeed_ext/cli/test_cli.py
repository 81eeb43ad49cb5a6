"""``moc-ckpt`` inspect / verify / consolidate (deepspeed_ext.cli)."""

import os
import sys

import pytest
import torch
from safetensors import safe_open

from deepspeed_ext import cli
from deepspeed_ext.cli import verify as verify_command
from tests.deepspeed_ext.format.test_manifest import (KINDS, expert_param, flip_last_byte,
                                                      rank_file, no_fsync, three_checkpoints, value)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
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


def test_densify_finds_the_window_behind_a_frame_rank_0_has_not_written(tmp_path, capsys,
                                                                         monkeypatch):
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
    _check_flags_in_process(monkeypatch)
    assert cli.main(["densify", str(save), "--out", str(tmp_path / "dense"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "replaying iterations 1..3" in out, out
    command = out.split("\n  ", 1)[1].split()
    shm = command[len(command) - 1 - command[::-1].index("--moc-shm-dir") + 1]
    assert shm != "/dev/shm/the-runs-own" and "moc-densify-" in shm  # the last one wins
    assert not os.path.exists(shm)  # removed again


# ----------------------------------------------------------------- densify: what it runs

RUN_CWD = "/the/runs/own/dir"


def _frames(save, command, cwd=RUN_CWD, world=2, frames=3):
    """A complete window [0..frames-1] of exact-mode frame markers (no tensors: densify
    reads the markers only before the replay), each recording ``command`` and ``cwd``."""
    import json
    from deepspeed_ext import exact as ex
    for frame in range(frames):
        os.makedirs(ex.frame_dir(str(save), frame), exist_ok=True)
        for rank in range(world):
            record = {"window_start": 0, "window": frames,
                      "groups": [[f"op{g}"] for g in range(frames)], "world_size": world,
                      "layout": {}, "cwd": cwd, "command": command}
            with open(os.path.join(ex.frame_dir(str(save), frame), f"rank{rank:05d}.json"),
                      "w") as f:
                json.dump(record, f)
    return os.path.join(ex.frame_dir(str(save), 0), "rank00000.json")


@pytest.fixture
def replays(monkeypatch, tmp_path):
    """The replay's subprocess.call, recorded instead of run (it writes the checkpoint's
    'latest' as a successful replay would); the test runs in a fresh directory."""
    import subprocess
    calls = []

    def call(cmd, **kwargs):
        calls.append((list(cmd), kwargs))
        save = cmd[len(cmd) - 1 - cmd[::-1].index("--save") + 1]
        end = cmd[len(cmd) - 1 - cmd[::-1].index("--exit-interval") + 1]
        os.makedirs(save, exist_ok=True)
        with open(os.path.join(save, "latest"), "w") as f:
            f.write(f"global_step{end}")
        return 0
    monkeypatch.setattr(subprocess, "call", call)
    _check_flags_in_process(monkeypatch)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    return calls


def _check_flags_in_process(monkeypatch):
    """The flag check densify asks of this project's own pretrain_gpt_moe.py
    (``--check-replay-flags``) answered in this process by the same function the program
    runs, so the densify tests start no process (a stand-in entry point elsewhere, as
    :func:`fake_entry_point` plants, still runs for real): the request and the answer
    still cross as the JSON the program reads and writes."""
    import io
    import subprocess
    from deepspeed_ext.cli.replay_flags import CHECK_REPLAY_FLAGS
    from megatron.training.replay_flags import answer
    real_run, ours = subprocess.run, os.path.join(REPO, "pretrain_gpt_moe.py")

    def run(cmd, *args, **kwargs):
        if (len(cmd) == 3 and cmd[2] == CHECK_REPLAY_FLAGS
                and os.path.abspath(cmd[1]) == os.path.abspath(ours)):
            out = io.StringIO()
            status = answer(io.StringIO(kwargs.get("input") or ""), out)
            return subprocess.CompletedProcess(cmd, status, out.getvalue(), "")
        return real_run(cmd, *args, **kwargs)
    monkeypatch.setattr(subprocess, "run", run)


def _printed_command(out):
    import shlex
    return shlex.split(out.split("\n  ", 1)[1].splitlines()[0])


def _script_and_flags(cmd):
    """The script torchrun runs and its flags (after --nproc-per-node N)."""
    at = cmd.index("--nproc-per-node") + 2
    return cmd[at], cmd[at + 1:]


@pytest.mark.parametrize("command, problem", [
    (["-c", "import os; open('PWNED', 'w').close()"], "starts with '-c'"),
    ([os.path.join("{tmp}", "evil.py"), "--num-layers", "2"], "evil.py"),
    (["-m", "evil", "--num-layers", "2"], "starts with '-m' 'evil'"),
    (["pretrain_gpt_moe.py", "--deepspeed_config", os.path.join("{tmp}", "ds.json")],
     "--deepspeed_config"),
    (["pretrain_gpt_moe.py", "--config", os.path.join("{tmp}", "evil.yaml")],
     "--deepspeed-config"),
    (["pretrain_gpt_moe.py", "--num-layers", "2", "--no-such-flag", "1"], "'--no-such-flag'"),
    (["pretrain_gpt_moe.py", "--help"], "'--help'"),
    (["pretrain_gpt_moe.py", "--bf16", "x.py"], "--bf16 takes no value"),
    (["pretrain_gpt_moe.py", "--data-path", "-c"], "no plain value"),
])
def test_densify_runs_nothing_a_checkpoint_names(tmp_path, replays, capsys, command, problem):
    """A frame marker's recorded command is data: densify never runs its script, module,
    interpreter options or a flag that names code; it exits 2 naming the problem, with
    --dry-run or without."""
    evil = tmp_path / "evil.py"
    evil.write_text("open(%r, 'w').close()\n" % str(tmp_path / "PWNED"))
    (tmp_path / "ds.json").write_text('{"torch_autocast": {"enabled": true, '
                                      '"lower_precision_safe_modules": ["evil.Module"]}}')
    (tmp_path / "evil.yaml").write_text("num-layers: 2\ndeepspeed-config: ds.json\n")
    command = [w.replace("{tmp}", str(tmp_path)) for w in command]
    marker = _frames(tmp_path / "ckpt", command, cwd=str(tmp_path))
    for dry in (["--dry-run"], []):
        argv = ["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "dense"), *dry]
        assert cli.main(argv) == 2, (command, dry)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and problem in err and marker in err, err
        assert "after --" in err, err  # how to give the flags instead
    assert replays == []
    assert not (tmp_path / "PWNED").exists() and not os.path.exists("PWNED")
    assert not (tmp_path / "dense").exists()


def test_densify_never_runs_a_planted_script_for_real(tmp_path, monkeypatch, capsys):
    """The same without a stand-in for the replay: the planted script must not run."""
    evil = tmp_path / "evil.py"
    evil.write_text("open(%r, 'w').close()\n" % str(tmp_path / "PWNED"))
    _frames(tmp_path / "ckpt", [str(evil), "--num-layers", "2"], cwd=str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "dense")]) == 2
    assert "evil.py" in capsys.readouterr().err
    assert not (tmp_path / "PWNED").exists()


def test_densify_replays_with_the_projects_entry_point_in_the_current_directory(
        tmp_path, replays, capsys):
    """The recorded script (wherever it was) is replaced by this project's
    pretrain_gpt_moe.py; the recorded cwd is never the replay's working directory (a
    note says relative paths now resolve from the current one); densify's own flags and
    fault injection are left out of the recorded ones."""
    from tests.launch import REPO
    project = os.path.join(REPO, "pretrain_gpt_moe.py")
    recorded = ["/elsewhere/pretrain_gpt_moe.py", "--num-layers", "2", "--data-path",
                "data/corpus", "--moc-fault", "crash@9:rank=1", "--save", "/orig/ckpt",
                "--load=/orig/ckpt", "--exit-interval", "99", "--moc-shm-dir", "/dev/shm/run",
                "--lr", "-1e-3", "--bf16"]
    _frames(tmp_path / "ckpt", recorded)
    out_dir = str(tmp_path / "dense")
    assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", out_dir, "--dry-run"]) == 0
    captured = capsys.readouterr()
    cmd = _printed_command(captured.out)
    script, flags = _script_and_flags(cmd)
    assert script == project and os.path.isfile(script)
    assert "/elsewhere" not in captured.out and RUN_CWD not in captured.out
    assert cmd[:2] == [sys.executable, "-P"] or cmd[:2] == [sys.executable, "-m"]
    assert flags[:8] == ["--num-layers", "2", "--data-path", "data/corpus", "--lr", "-1e-3",
                         "--bf16", "--load"]
    assert flags.count("--save") == 1 and flags[flags.index("--save") + 1] == out_dir
    assert flags[flags.index("--exit-interval") + 1] == "3"
    assert "--moc-fault" not in flags and "crash@9:rank=1" not in flags
    assert f"note: the run's working directory was {RUN_CWD}" in captured.err
    assert "-- FLAGS" in captured.err
    assert replays == []  # a dry run runs nothing
    # The real thing (stand-in replay): the same command, in the current directory.
    assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", out_dir]) == 0
    (ran, kwargs), = replays
    assert kwargs.get("cwd") is None
    assert _script_and_flags(ran)[0] == project
    assert not os.path.exists("PWNED")


def test_densify_reads_a_recorded_config_file_itself(tmp_path, replays, capsys):
    """A recorded --config is read and checked by densify, and replaced by the flags it
    stands for (the file's first, so the command's still win): the replay reads no file
    that could change after the check."""
    config = tmp_path / "run.yaml"
    config.write_text("num-layers: 2\nlr: 0.5\nsave: /orig/ckpt\nmoc:\n  window: 3\n")
    _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--config", str(config), "--lr", "0.1"],
            cwd=os.getcwd())
    assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d"),
                     "--dry-run"]) == 0
    captured = capsys.readouterr()
    _, flags = _script_and_flags(_printed_command(captured.out))
    assert flags[:8] == ["--num-layers", "2", "--lr", "0.5", "--moc-window", "3", "--lr", "0.1"]
    assert "--config" not in flags and flags.count("--save") == 1
    assert "note:" not in captured.err  # run from the recorded directory: no note
    # A recorded config that cannot be read (relative to the current directory now).
    _frames(tmp_path / "ckpt2", ["pretrain_gpt_moe.py", "--config", "configs/nope.yaml"])
    assert cli.main(["densify", str(tmp_path / "ckpt2"), "--out", str(tmp_path / "d"),
                     "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "configs/nope.yaml" in err and "current directory" in err and "after --" in err
    _frames(tmp_path / "ckpt3", ["pretrain_gpt_moe.py", "--config", "/dev/zero"])
    assert cli.main(["densify", str(tmp_path / "ckpt3"), "--out", str(tmp_path / "d"),
                     "--dry-run"]) == 2  # not read forever
    assert "--config /dev/zero" in capsys.readouterr().err


def test_densify_uses_the_flags_given_after_double_dash(tmp_path, replays, capsys):
    """``densify DIR --out OUT -- FLAGS...``: the user's flags replace the recorded ones
    (even a recorded command densify would refuse), after this project's script."""
    _frames(tmp_path / "ckpt", ["/tmp/evil.py", "--num-layers", "7"])
    mine = ["--config", "configs/tiny.yaml", "--data-path", "/data/corpus", "--seed=3"]
    base = ["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "dense")]
    assert cli.main(base + ["--dry-run", "--"] + mine) == 0
    captured = capsys.readouterr()
    script, flags = _script_and_flags(_printed_command(captured.out))
    assert os.path.basename(script) == "pretrain_gpt_moe.py" and script == cli.entry_point()
    assert flags[:len(mine)] == mine and "7" not in flags and "evil" not in captured.out
    assert "given after --" in captured.out and "note:" not in captured.err
    assert cli.main(base + ["--"] + mine) == 0
    (ran, kwargs), = replays
    assert _script_and_flags(ran)[1][:len(mine)] == mine and kwargs.get("cwd") is None
    # What densify sets itself, and an empty --, are refused.
    for bad in (["--save", "/x"], ["--load=/x"], ["--moc-shm-dir", "/dev/shm/x"], []):
        assert cli.main(base + ["--dry-run", "--"] + bad) == 2, bad
        assert capsys.readouterr().err.startswith("error: ")
    assert len(replays) == 1


def _write_marker(path, record):
    import json
    with open(path, "w") as f:
        json.dump(record, f)


@pytest.mark.parametrize("case", ["dict", "string", "huge", "not-str", "long-word", "nul",
                                  "escape", "cwd-number", "record-list", "world-size-list"])
def test_densify_refuses_a_malformed_marker_without_a_traceback(tmp_path, replays, capsys,
                                                                case):
    command = ["pretrain_gpt_moe.py", "--num-layers", "2"]
    record_command, cwd = {
        "dict": ({"script": "evil.py"}, RUN_CWD),
        "string": ("python evil.py", RUN_CWD),
        "huge": (["pretrain_gpt_moe.py"] + ["--bf16"] * 5000, RUN_CWD),
        "not-str": (["pretrain_gpt_moe.py", "--num-layers", 2], RUN_CWD),
        "long-word": (["pretrain_gpt_moe.py", "--data-path", "x" * 5000], RUN_CWD),
        "nul": (["pretrain_gpt_moe.py", "--data-path", "a\x00b"], RUN_CWD),
        "escape": (["pretrain_gpt_moe.py", "--data-path", "\x1b[2J"], RUN_CWD),
        "cwd-number": (command, 5),
    }.get(case, (command, RUN_CWD))
    marker = _frames(tmp_path / "ckpt", record_command, cwd=cwd)
    if case == "record-list":
        _write_marker(marker, [command])
    if case == "world-size-list":  # in the newest frame, where densify reads it first
        newest = os.path.join(os.path.dirname(os.path.dirname(marker)), "frame00000002")
        for name in os.listdir(newest):
            _write_marker(os.path.join(newest, name), {"world_size": [2]})
    for dry in (["--dry-run"], []):
        assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d"),
                         *dry]) == 2, case
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, err
    assert replays == []


def test_densify_refuses_a_world_size_no_frame_can_complete(tmp_path, replays, capsys):
    """A marker claiming a huge world is refused at once (not a search over a billion
    ranks' markers, nor that many local processes)."""
    marker = _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--num-layers", "2"])
    newest = os.path.join(os.path.dirname(os.path.dirname(marker)), "frame00000002")
    _write_marker(os.path.join(newest, "rank00000.json"), {"world_size": 10 ** 9})
    assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "world_size 1000000000" in err and "no window is complete" in err
    assert replays == []


def test_densify_needs_the_projects_own_entry_point(tmp_path, replays, capsys, monkeypatch):
    import deepspeed_ext
    _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--num-layers", "2"])
    monkeypatch.setattr(deepspeed_ext, "__file__",
                        str(tmp_path / "site" / "deepspeed_ext" / "__init__.py"))
    for extra in ([], ["--", "--num-layers", "2"]):
        assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d"),
                         *extra]) == 2
        err = capsys.readouterr().err
        assert "cannot find this project's pretrain_gpt_moe.py" in err
        assert str(tmp_path / "site") in err
    assert replays == []


# ------------------------------------------- densify: the entry point checks the flags

_FAKE_ENTRY_POINT = """import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "request.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "request": json.load(sys.stdin)}, f)
with open(os.path.join(here, "reply.json")) as f:
    reply = json.load(f)
time.sleep(reply.get("sleep", 0))
sys.stdout.write(reply["stdout"])
sys.stderr.write(reply.get("stderr", ""))
sys.exit(reply["status"])
"""


@pytest.fixture
def fake_entry_point(tmp_path, monkeypatch):
    """A stand-in for this project's pretrain_gpt_moe.py, found by densify beside the
    package: it records the request it was given (request.json) and answers as the test
    writes (reply.json: its stdout, stderr and exit status). Returns a function that sets
    the answer and returns the recorded request after densify ran."""
    import json
    import deepspeed_ext
    site = tmp_path / "site"
    (site / "deepspeed_ext").mkdir(parents=True)
    (site / "pretrain_gpt_moe.py").write_text(_FAKE_ENTRY_POINT)
    monkeypatch.setattr(deepspeed_ext, "__file__", str(site / "deepspeed_ext" / "__init__.py"))

    def answer(stdout, status=0, stderr="", sleep=0):
        (site / "reply.json").write_text(json.dumps(
            {"stdout": stdout, "status": status, "stderr": stderr, "sleep": sleep}))
        return lambda: json.loads((site / "request.json").read_text())
    return answer


def _reply(flags=(), left_out=(), densify_sets=()):
    import json
    return json.dumps({"flags": list(flags), "left_out": list(left_out),
                       "densify_sets": list(densify_sets)}) + "\n"


def test_densify_asks_the_entry_point_and_replays_with_its_answer(tmp_path, replays, capsys,
                                                                  fake_entry_point):
    """densify sends the recorded flags (the script dropped) with the marker, its own
    flags and its bounds to ``pretrain_gpt_moe.py --check-replay-flags`` and replays with
    the flags of the answer's last line (a banner before it is ignored)."""
    marker = _frames(tmp_path / "ckpt", ["/elsewhere/pretrain_gpt_moe.py", "--num-layers", "2",
                                         "--moc-fault", "crash@1"])
    request = fake_entry_point("a banner on import\n" + _reply(["--num-layers", "3"],
                                                               ["--moc-fault"]))
    assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d"),
                     "--dry-run"]) == 0
    captured = capsys.readouterr()
    script, flags = _script_and_flags(_printed_command(captured.out))
    assert script == str(tmp_path / "site" / "pretrain_gpt_moe.py")
    assert flags[:3] == ["--num-layers", "3", "--load"]
    assert "leaving out the recorded --moc-fault" in captured.err
    assert request() == {"argv": ["--check-replay-flags"], "request": {
        "kind": "recorded", "words": ["--num-layers", "2", "--moc-fault", "crash@1"],
        "marker": marker, "densify_sets": ["--load", "--save", "--moc-shm-dir",
                                           "--exit-interval"],
        "max_word_chars": cli.MAX_TOKEN_CHARS, "max_config_bytes": cli.MAX_CONFIG_BYTES}}
    assert replays == []


def test_densify_passes_on_the_entry_points_refusal_and_refuses_a_flag_it_sets(
        tmp_path, replays, capsys, fake_entry_point):
    _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--num-layers", "2"])
    base = ["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d"), "--dry-run"]
    fake_entry_point('{"error": "the command recorded in M: unknown flag \'--x\'"}\n', 2)
    assert cli.main(base) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the command recorded in M: unknown flag '--x'. densify ")
    assert "after --" in err
    request = fake_entry_point(_reply(["--save", "/x"], densify_sets=["--save"]))
    assert cli.main(base + ["--", "--save", "/x"]) == 2
    err = capsys.readouterr().err
    assert "densify sets --load, --save, --moc-shm-dir, --exit-interval itself" in err
    assert "leave --save out" in err
    assert request()["request"]["kind"] == "given"
    assert request()["request"]["words"] == ["--save", "/x"]
    assert replays == []


@pytest.mark.parametrize("case", ["crash", "no-json", "wrong-types", "status-1-json",
                                  "timeout"])
def test_densify_reports_an_entry_point_that_gives_no_answer(tmp_path, replays, capsys,
                                                             fake_entry_point, monkeypatch,
                                                             case):
    """A failing entry point (another version, a broken install) is named, exit 2, with
    what it printed; densify does not blame the recorded flags, nor replay anything."""
    from deepspeed_ext.cli import replay_flags
    _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--num-layers", "2"])
    monkeypatch.setattr(replay_flags, "CHECK_TIMEOUT_S", 1.0)
    fake_entry_point(**{
        "crash": dict(stdout="", status=1, stderr="ModuleNotFoundError: No module named 'yaml'"),
        "no-json": dict(stdout="usage: pretrain_gpt_moe.py\n", status=2),
        "wrong-types": dict(stdout='{"flags": "--num-layers 2", "left_out": [], '
                                   '"densify_sets": []}\n'),
        "status-1-json": dict(stdout=_reply(["--num-layers", "2"]), status=1),
        "timeout": dict(stdout=_reply(), sleep=30),
    }[case])
    for extra in ([], ["--", "--num-layers", "2"]):
        assert cli.main(["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d"),
                         *extra]) == 2, (case, extra)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "--check-replay-flags" in err, err
        assert ("timed out" in err) if case == "timeout" else ("gave no answer" in err), err
        assert "No module named 'yaml'" in err or case != "crash"
        assert "give the training flags after --" not in err
    assert replays == []


def test_densify_checks_the_flags_the_entry_point_answers(tmp_path, replays, capsys,
                                                          fake_entry_point):
    """What the entry point answers is checked before it reaches the replay: no control
    character, no more words than a recorded command may have."""
    _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--num-layers", "2"])
    argv = ["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d"), "--dry-run"]
    fake_entry_point(_reply(["--data-path", "\x1b[2J"]))
    assert cli.main(argv) == 2
    assert "holds a control character" in capsys.readouterr().err
    fake_entry_point(_reply(["--bf16"] * (cli.MAX_RECORDED_TOKENS + 1)))
    assert cli.main(argv) == 2
    assert f"{cli.MAX_RECORDED_TOKENS + 1} words with its --config files" in \
        capsys.readouterr().err
    assert replays == []


def test_verify_follows_latest_to_a_checkpoint_committed_while_it_ran(tmp_path, monkeypatch, capsys):
    """A keeper still committing (a job that died left persists behind, as the keeper is
    meant to finish them) moves ``latest`` to a checkpoint committed after verify listed
    the directory. verify read ``latest`` only at the end and compared it with that
    listing: it reported ``latest`` naming no complete checkpoint. It now verifies what
    ``latest`` names."""
    from tests.deepspeed_ext.commit_helpers import commit_keeping
    save_dir = str(tmp_path)
    for step in (10, 20):
        commit_keeping(save_dir, f"global_step{step}", step, step / 10, 1.0, 0)
    real = verify_command.verify_checkpoint
    landed = []

    def verify_while_a_commit_lands(path, tag, checksums=True):
        if not landed:  # the keeper commits 30 (manifest, then latest) meanwhile
            landed.append(commit_keeping(save_dir, "global_step30", 30, 3.0, 1.0, 0))
        return real(path, tag, checksums)

    monkeypatch.setattr(verify_command, "verify_checkpoint", verify_while_a_commit_lands)
    assert cli.main(["verify", save_dir]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "OK     global_step30" in out and "FAILED" not in out


def test_verify_is_not_undercut_by_retention_of_the_checkpoint_it_reads(tmp_path, monkeypatch,
                                                                        capsys):
    """A committer's retention running while verify reads a checkpoint that is no longer
    among the newest: verify pins it, and retention leaves it (before, verify found its
    files gone and reported it damaged)."""
    from deepspeed_ext.store import retention
    from tests.deepspeed_ext.commit_helpers import commit_keeping
    save_dir = str(tmp_path)
    for step in (10, 20, 30):
        commit_keeping(save_dir, f"global_step{step}", step, step / 10, 1.0, 0)
    real = verify_command.verify_checkpoint
    removed = []

    def verify_under_retention(path, tag, checksums=True):
        if tag == "global_step10":
            removed.extend(retention.apply_retention(save_dir, 1))
        return real(path, tag, checksums)

    monkeypatch.setattr(verify_command, "verify_checkpoint", verify_under_retention)
    assert cli.main(["verify", save_dir]) == 0, capsys.readouterr().out
    assert removed == ["global_step20"]
    out = capsys.readouterr().out
    assert "OK     global_step10" in out and "FAILED" not in out


# ------------------------------------------------------------- densify: where it runs

def test_densify_replays_across_a_hostfile_with_deepspeeds_launcher(tmp_path, replays, capsys):
    """A run's frames from 4 ranks on 2 hosts: with --hostfile the replay starts
    DeepSpeed's launcher over those hosts (before: always torchrun on this host)."""
    _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--num-layers", "2"], world=4)
    hosts = tmp_path / "hosts"
    hosts.write_text("# the job's nodes\nnode-a slots=2\nnode-b slots=2\n")
    argv = ["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "dense"),
            "--hostfile", str(hosts)]
    assert cli.main(argv) == 0, capsys.readouterr()
    cmd = replays[0][0]
    assert cmd[:3] == ["deepspeed", "--hostfile", str(hosts)], cmd
    assert "torch.distributed.run" not in cmd
    assert "the 4 slots of" in capsys.readouterr().out


@pytest.mark.parametrize("text, problem", [
    ("node-a slots=2\n", "has 2 slots; the frames were written by 4 ranks"),
    ("node-a slots=2\nnode-b\n", "line 2: expected 'HOST slots=N'"),
    ("node-a slots=0\nnode-b slots=4\n", "line 1"),
    ("# nothing\n", "names no host"),
])
def test_densify_refuses_a_hostfile_that_does_not_fit_the_frames(tmp_path, replays, capsys,
                                                                 text, problem):
    _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--num-layers", "2"], world=4)
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    argv = ["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "dense"),
            "--hostfile", str(hosts)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--hostfile" in err and problem in err, err
    assert replays == []


def test_densify_on_one_host_refuses_more_ranks_than_its_gpus(tmp_path, replays, capsys,
                                                              monkeypatch):
    """4 ranks' frames on a host with 2 GPUs: NCCL would refuse two ranks on one device
    at the first collective; densify says so up front and names --hostfile, and leaves
    no directory behind (the replay's shared-memory one was made before the check, and
    every refused densify left one in /dev/shm)."""
    import tempfile

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    made = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp",
                        lambda *a, **k: made.append(real_mkdtemp(*a, **k)) or made[-1])
    _frames(tmp_path / "ckpt", ["pretrain_gpt_moe.py", "--num-layers", "2"], world=4)
    argv = ["densify", str(tmp_path / "ckpt"), "--out", str(tmp_path / "dense")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "4 ranks" in err and "2 GPU(s)" in err and "--hostfile" in err, err
    assert replays == []
    assert [d for d in made if os.path.exists(d)] == []
