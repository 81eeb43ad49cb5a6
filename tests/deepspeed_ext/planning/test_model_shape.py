"""moc-plan reads a training config by asking this project's pretrain_gpt_moe.py
(``--model-shape``), never by importing the trainer: the real program's answer, the
exchange's refusals on either side, and an entry point that gives no valid answer."""

import io
import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest

from deepspeed_ext.planning import cli
from deepspeed_ext.planning.cli import PlanError, model_from_config
from tests.deepspeed_ext.planning.conftest import CONFIG_16E, REAL_RUN, REPO


def test_the_real_entry_point_answers_as_the_in_process_one(monkeypatch):
    """The one test that starts pretrain_gpt_moe.py --model-shape for real."""
    in_process = model_from_config(CONFIG_16E, ep_override=8, gpus=16)
    monkeypatch.setattr(subprocess, "run", REAL_RUN)
    real = model_from_config(CONFIG_16E, ep_override=8, gpus=16)
    assert real == in_process
    assert (real.name, real.num_experts, real.tokens_per_iteration) == (
        "gpt-350m-16e", 16, 256 * 2048)


def test_the_planner_and_the_entry_point_agree_on_the_flag():
    import pretrain_gpt_moe
    assert cli.MODEL_SHAPE == pretrain_gpt_moe.MODEL_SHAPE
    assert cli.ENTRY_POINT == os.path.basename(pretrain_gpt_moe.__file__)


def _answer(request) -> tuple:
    from megatron.training.model_shape import answer
    out = io.StringIO()
    status = answer(io.StringIO(request if isinstance(request, str) else json.dumps(request)),
                    out)
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1  # one line
    return status, json.loads(out.getvalue())


def test_the_trainer_answers_the_shapes_fields_or_an_error():
    status, reply = _answer({"config": CONFIG_16E, "ep": 0, "gpus": 16})
    assert status == 0
    assert asdict(model_from_config(CONFIG_16E, gpus=16)) == reply
    status, reply = _answer({"config": CONFIG_16E, "ep": 0, "gpus": 128})
    assert status == 2 and "--micro-batch-size x data-parallel size" in reply["error"]


@pytest.mark.parametrize("request_text", [
    "not json", "[]", json.dumps({"config": CONFIG_16E, "ep": 0}),
    json.dumps({"config": 1, "ep": 0, "gpus": 0}),
    json.dumps({"config": CONFIG_16E, "ep": -1, "gpus": 0}),
    json.dumps({"config": CONFIG_16E, "ep": 0, "gpus": True}),
])
def test_the_trainer_refuses_a_malformed_request(request_text):
    status, reply = _answer(request_text)
    assert status == 2 and "the request on stdin is not" in reply["error"]


def test_a_config_that_is_no_model_config(tmp_path):
    path = tmp_path / "data-only.yaml"
    path.write_text("seq-length: 128\n")
    with pytest.raises(PlanError, match=f"--config {path}: no num-layers .not a model config."):
        model_from_config(str(path))
    path.write_text("no-such-flag: 1\n")
    with pytest.raises(PlanError, match=f"--config {path}: "):
        model_from_config(str(path))


def _entry_point_says(monkeypatch, returncode, stdout, stderr=""):
    def run(cmd, *args, **kwargs):
        assert cmd[1:] == [os.path.join(REPO, cli.ENTRY_POINT), cli.MODEL_SHAPE]
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)
    monkeypatch.setattr(subprocess, "run", run)


def test_the_trainers_message_is_the_planners(monkeypatch):
    _entry_point_says(monkeypatch, 2, "a banner\n" + json.dumps({"error": "--config x: bad"}))
    with pytest.raises(PlanError, match="^--config x: bad$"):
        model_from_config(CONFIG_16E)


good = {"name": "m", "params_non_expert": 1, "params_expert": 2, "num_experts": 2,
        "num_moe_layers": 1, "tokens_per_iteration": 8}


@pytest.mark.parametrize("returncode,stdout", [
    (1, ""),                                            # crashed before answering
    (0, "not json\n"),
    (0, json.dumps({"error": "x"})),                    # an error with exit status 0
    (2, json.dumps(good)),                              # fields with exit status 2
    (0, json.dumps(dict(good, num_experts="2"))),       # a field of the wrong type
    (0, json.dumps(dict(good, params_expert=1.5))),
    (0, json.dumps({k: v for k, v in good.items() if k != "name"})),
    (0, json.dumps(dict(good, extra=1))),
    (0, json.dumps(dict(good, num_experts=0))),          # out of the shape's bounds
])
def test_no_valid_answer_names_the_entry_point(monkeypatch, returncode, stdout):
    _entry_point_says(monkeypatch, returncode, stdout, stderr="Traceback: boom")
    with pytest.raises(PlanError) as err:
        model_from_config(CONFIG_16E)
    message = str(err.value)
    assert f"pretrain_gpt_moe.py {cli.MODEL_SHAPE} gave no model shape for --config" in message
    assert f"(exit status {returncode}): Traceback: boom" in message


def test_a_valid_answer_is_the_shape(monkeypatch):
    _entry_point_says(monkeypatch, 0, "a banner\n" + json.dumps(good) + "\n\n")
    assert asdict(model_from_config(CONFIG_16E)) == good


def test_an_entry_point_that_does_not_start(monkeypatch):
    def run(cmd, *args, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(PlanError, match=f"{cli.MODEL_SHAPE} could not read --config"):
        model_from_config(CONFIG_16E)


def test_a_missing_entry_point_is_named(monkeypatch):
    monkeypatch.setattr(cli, "ENTRY_POINT", "no_such_script.py")
    with pytest.raises(PlanError, match="cannot find this project's no_such_script.py in "):
        model_from_config(CONFIG_16E)


def test_the_request_names_the_config_the_ep_and_the_gpus(monkeypatch):
    seen = []

    def run(cmd, *args, **kwargs):
        seen.append((cmd[0], json.loads(kwargs["input"])))
        return subprocess.CompletedProcess(cmd, 0, json.dumps(good), "")
    monkeypatch.setattr(subprocess, "run", run)
    model_from_config(CONFIG_16E, ep_override=4, gpus=8)
    assert seen == [(sys.executable, {"config": CONFIG_16E, "ep": 4, "gpus": 8})]
