"""The trainer's answer to densify's flag check (megatron.training.replay_flags), called
in this process with the request and answer as text: what the entry point's
``--check-replay-flags`` path does for ``moc-ckpt densify`` (tests/deepspeed_ext/cli/test_cli.py
runs it as a program, through densify)."""

import io
import json

import pytest

import pretrain_gpt_moe
from deepspeed_ext.cli import replay_flags as library
from megatron.training.replay_flags import answer

OWN = ["--load", "--save", "--moc-shm-dir", "--exit-interval"]


def _ask(words, kind="recorded", **fields):
    """(exit status, the answer's JSON object) for ``words``."""
    request = {"kind": kind, "words": words, "marker": "M.json", "densify_sets": OWN,
               "max_word_chars": 4096, "max_config_bytes": 1 << 20, **fields}
    out = io.StringIO()
    status = answer(io.StringIO(json.dumps(request)), out)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1  # one JSON line, nothing else
    return status, json.loads(text)


def test_recorded_flags_keep_the_training_flags_and_drop_densifys_own_and_faults():
    status, reply = _ask(["--num-layers", "2", "--data-path", "data/corpus", "--moc-fault",
                          "crash@9:rank=1", "--save", "/orig/ckpt", "--load=/orig/ckpt",
                          "--exit-interval", "99", "--moc-shm-dir", "/dev/shm/run",
                          "--lr", "-1e-3", "--bf16", "--moc-fault-seed=4"])
    assert status == 0
    assert reply == {"flags": ["--num-layers", "2", "--data-path", "data/corpus", "--lr",
                               "-1e-3", "--bf16"],
                     "left_out": ["--moc-fault", "--moc-fault-seed"], "densify_sets": []}


def test_a_recorded_config_file_is_read_now_and_its_flags_come_first(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("num-layers: 2\nlr: 0.5\nsave: /orig/ckpt\nmoc:\n  window: 3\n")
    status, reply = _ask(["--config", str(config), "--lr", "0.1"])
    assert status == 0
    assert reply["flags"] == ["--num-layers", "2", "--lr", "0.5", "--moc-window", "3",
                              "--lr", "0.1"]


@pytest.mark.parametrize("words, problem", [
    (["--num-layers", "2", "--no-such-flag", "1"], "unknown flag '--no-such-flag'"),
    (["--help"], "unknown flag '--help'"),
    (["2", "--num-layers"], "'2' where a flag should be"),
    (["--bf16", "x.py"], "--bf16 takes no value, but has 'x.py'"),
    (["--bf16=x.py"], "--bf16 takes no value"),
    (["--data-path", "-c"], "--data-path has the value '-c', which is no plain value"),
    (["--deepspeed_config", "ds.json"], "--deepspeed_config: a DeepSpeed config"),
    (["--config"], "--config takes one file, got 0"),
    (["--config", "a.yaml", "b.yaml"], "--config takes one file, got 2"),
])
def test_recorded_flags_refused_name_the_flag_and_the_marker(words, problem):
    status, reply = _ask(words)
    assert status == 2 and set(reply) == {"error"}
    assert problem in reply["error"] and "the command recorded in M.json" in reply["error"]


@pytest.mark.parametrize("text, problem", [
    ("num-layers: 2\ndeepspeed-config: ds.json\n", "--deepspeed-config: a DeepSpeed config"),
    ("data-path: \"\\e[2J\"\n", "holds a control character"),
    ("data-path: " + "x" * 40 + "\n", "a word of 40 characters (at most 30)"),
    ("no-such-key: 1\n", "unknown key 'no-such-key'"),
    ("- a list\n", "must hold a mapping"),
    ("x" * 200 + ": 1\n", "larger than 100 bytes"),
])
def test_a_recorded_config_file_refused_is_named(tmp_path, text, problem):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    status, reply = _ask(["--config", str(config)], max_word_chars=30, max_config_bytes=100)
    assert status == 2 and problem in reply["error"], reply
    assert str(config) in reply["error"] and "M.json" in reply["error"]


def test_a_recorded_config_that_is_no_file_is_refused_naming_the_current_directory(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path, hint in (("/dev/zero", False), ("configs/nope.yaml", True)):
        status, reply = _ask(["--config", path])
        assert status == 2 and f"--config {path}" in reply["error"]
        assert "not a file" in reply["error"] and "recorded in M.json" in reply["error"]
        assert ("current directory " + str(tmp_path) in reply["error"]) == hint


def test_given_flags_are_kept_and_those_densify_sets_named():
    words = ["--config", "configs/tiny.yaml", "--save", "/x", "--seed=3", "--load=/y",
             "--deepspeed_config", "ds.json"]
    assert _ask(words, kind="given") == (0, {"flags": words, "left_out": [],
                                             "densify_sets": ["--save", "--load"]})


def test_a_request_that_is_not_one_is_refused_without_a_traceback():
    good = {"kind": "given", "words": [], "marker": "", "densify_sets": OWN,
            "max_word_chars": 1, "max_config_bytes": 1}
    bad = ["not json", "[1]", json.dumps({**good, "kind": "run"}),
           json.dumps({**good, "words": ["--bf16", 3]}),
           json.dumps({**good, "max_word_chars": True}),
           json.dumps({**good, "max_config_bytes": 0}),
           json.dumps({k: v for k, v in good.items() if k != "marker"})]
    for text in bad:
        out = io.StringIO()
        assert answer(io.StringIO(text), out) == 2, text
        assert "request on stdin" in json.loads(out.getvalue())["error"]
    assert answer(io.StringIO(json.dumps(good)), io.StringIO()) == 0


def test_a_flag_densify_sets_that_the_trainer_does_not_know_is_a_version_mismatch():
    status, reply = _ask(["--num-layers", "2"], densify_sets=OWN + ["--moc-no-such"])
    assert status == 2
    assert "--moc-no-such" in reply["error"] and "different versions" in reply["error"]


def test_the_entry_point_answers_the_check_and_trains_nothing(monkeypatch, capsys):
    """``pretrain_gpt_moe.py --check-replay-flags``: the request on stdin, the answer on
    stdout; the library names the same argument."""
    assert library.CHECK_REPLAY_FLAGS == pretrain_gpt_moe.CHECK_REPLAY_FLAGS
    assert library.DENSIFY_SETS == tuple(OWN)
    request = {"kind": "recorded", "words": ["--num-layers", "2", "--save", "/s"],
               "marker": "M.json", "densify_sets": OWN, "max_word_chars": 9,
               "max_config_bytes": 9}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(request)))
    assert pretrain_gpt_moe.main([pretrain_gpt_moe.CHECK_REPLAY_FLAGS]) == 0
    assert json.loads(capsys.readouterr().out)["flags"] == ["--num-layers", "2"]
    # Anywhere but alone it is no flag of the trainer's: refused as an unknown one.
    assert pretrain_gpt_moe.main(["--num-layers", "2", pretrain_gpt_moe.CHECK_REPLAY_FLAGS]) == 2
    assert "unrecognized arguments: --check-replay-flags" in capsys.readouterr().err
