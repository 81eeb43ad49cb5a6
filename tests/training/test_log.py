"""The trainer's log line, TensorBoard tags and W&B (megatron/training/log.py, tb_tags.py,
wandb_log.py): Megatron-DeepSpeed's field wording and order, its tag names, W&B through a
fake module (no network), and the refusals."""

import importlib.util
import json
import math
import sys
import types
from argparse import Namespace

import pytest

from megatron.errors import ConfigError
from megatron.training import wandb_log
from megatron.training.arguments import parse_args, validate_args
from megatron.training.log import (MetricsWriter, is_nan_iteration, throughput,
                                   training_log_line)
from megatron.training.tb_tags import (Position, interval_scalars, training_scalars,
                                       validation_scalars)
from megatron.training.training import optimizer_loss_scale

BASE = ["--config", "configs/tiny.yaml", "--data-path", "x", "--moe-expert-parallel-size", "1"]

STATS = {"consumed_samples": 80, "consumed_tokens": 5120, "elapsed_ms": 250.0,
         "tokens_per_s": 2048.0, "lr": 1e-3, "global_batch_size": 8, "lm_loss": 5.0,
         "moe_aux_loss": 1.5, "loss_scale": 4096.0, "grad_norm": 0.25, "seq_length": 64,
         "skipped": 2, "nan": 1, "samples_per_s": 32.0, "tgs": 1024.0}


def fields(line):
    """``{name: value}`` of a ``| name: value |`` line, in order."""
    out = {}
    for part in line.split("|")[1:]:
        if ":" in part:
            name, value = part.rsplit(":", 1)
            out[name.strip()] = value.strip()
    return out


def test_line_has_megatron_deepspeed_fields_in_their_order():
    line = training_log_line(10, 100, STATS)
    assert line.startswith(" iteration       10/     100 | consumed samples:           80 |")
    got = fields(line)
    assert list(got) == [
        "consumed samples", "consumed tokens", "elapsed time per iteration (ms)",
        "tokens per second", "learning rate", "global batch size", "lm loss", "moe aux loss",
        "loss scale", "grad norm", "actual seqlen", "number of skipped iterations",
        "number of nan iterations", "samples per second", "tokens per gpu per second (tgs)"]
    assert got["consumed tokens"] == "5120" and got["loss scale"] == "4096.0"
    assert got["actual seqlen"] == "64" and got["number of nan iterations"] == "1"
    assert got["samples per second"] == "32.000"
    assert got["tokens per gpu per second (tgs)"] == "1024.000"
    assert "TFLOPs" not in line  # an estimate, not a measurement: not printed


def test_line_without_a_loss_scale_leaves_the_field_out():
    line = training_log_line(10, 100, dict(STATS, loss_scale=None))
    assert "loss scale" not in line and "grad norm: 0.250 |" in line


def test_throughput_and_nan_iterations():
    rates = throughput(iterations=4, elapsed_s=2.0, global_batch_size=8, seq_length=64,
                       world_size=2)
    assert rates == {"samples_per_s": 16.0, "tokens_per_s": 1024.0, "tgs": 512.0}
    assert is_nan_iteration(True, 1.0, float("nan"))
    assert is_nan_iteration(True, float("inf"))
    assert not is_nan_iteration(True, 1.0, 2.0)  # skipped (overflow in the grads) only
    assert not is_nan_iteration(False, float("nan"))  # as upstream: skipped steps only


def test_loss_scale_of_deepspeed_optimizers():
    assert optimizer_loss_scale(types.SimpleNamespace(cur_scale=65536.0)) == 65536.0  # ZeRO 1/2
    assert optimizer_loss_scale(types.SimpleNamespace(loss_scale=1024)) == 1024.0  # fp16, stage 0
    assert optimizer_loss_scale(types.SimpleNamespace(loss_scale=None)) is None
    assert optimizer_loss_scale(object()) is None  # torch's AdamW: fp32, stage 0


class FakeSummaryWriter:
    instances = []

    def __init__(self, log_dir, max_queue):
        self.log_dir, self.max_queue, self.scalars, self.closed = log_dir, max_queue, [], False
        FakeSummaryWriter.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    """``torch.utils.tensorboard`` replaced by a module whose SummaryWriter records."""
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    FakeSummaryWriter.instances = []
    return FakeSummaryWriter


def train_scalars(**kw):
    at = Position(iteration=3, samples=24, tokens=24 * 64)
    args = dict(losses={"lm loss": 5.0, "moe aux loss": 1.5}, lr=1e-3, grad_norm=0.25,
                batch_size=8, seq_length=64)
    args.update(kw)
    return training_scalars(at, **args)


def test_tensorboard_tags_are_megatron_deepspeeds(fake_tensorboard, tmp_path):
    writer = MetricsWriter(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"), queue_size=7)
    record = {"lm_loss": 5.0, "lr": 1e-3}
    writer.write("train", 3, record, scalars=train_scalars(
        loss_scale=1024.0, fp16=True, log_batch_size=True))
    writer.write("moc", 3, {"plt": 0.5})
    writer.close()
    tb = fake_tensorboard.instances[0]
    assert tb.max_queue == 7 and tb.closed
    got = {tag: (value, step) for tag, value, step in tb.scalars}
    assert got["lm-loss-training/lm loss"] == (5.0, 3)
    assert got["lm-loss-training/lm loss vs samples"] == (5.0, 24)
    assert got["lm-loss-training/lm loss vs tokens"] == (5.0, 24 * 64)
    assert got["lm-loss-training/moe aux loss"] == (1.5, 3)
    assert got["learning-rate/learning-rate"] == (1e-3, 3)
    assert got["learning-rate/learning-rate vs samples"] == (1e-3, 24)
    assert got["batch-size/batch-size"] == (8, 3)
    assert got["loss-scale/loss-scale vs tokens"] == (1024.0, 24 * 64)
    assert got["grad-norm/grad-norm"] == (0.25, 3)
    assert got["seqlen/actual_seq_length"] == (64, 3)
    assert got["steps-vs-samples/y=steps,x=samples"] == (3, 24)
    assert got["steps-vs-tokens/y=tokens,x=steps"] == (24 * 64, 3)
    assert got["moc/plt"] == (0.5, 3)  # MoC's own keep their prefix
    assert not [t for t in got if t.startswith("train/")]
    # the metrics file keeps its records
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[0] == {"kind": "train", "iteration": 3, **record}


def test_tags_gated_like_upstream():
    tags = {s.tag for s in train_scalars(loss_scale=1.0, fp16=False)}
    assert not [t for t in tags if t.startswith(("batch-size/", "loss-scale/"))]
    tags = {s.tag for s in train_scalars(loss_scale=None, fp16=True)}
    assert not [t for t in tags if t.startswith("loss-scale/")]
    at = Position(6, 48, 48 * 64)
    rates = {"samples_per_s": 16.0, "tokens_per_s": 1024.0, "tgs": 512.0}
    plain = interval_scalars(at, {"lm loss": 5.0}, 0.5, rates, world_size=2)
    assert all(s.wandb_only for s in plain)
    assert {s.tag: s.value for s in plain}["throughput/samples_per_sec_per_replica"] == 8.0
    timed = {s.tag: s.value for s in interval_scalars(at, {}, 0.5, rates, 2, log_timers=True)}
    assert timed["iteration-time/iteration-time"] == 0.5
    assert timed["iteration-time/iteration-time vs samples"] == 0.5
    valid = {s.tag: (s.value, s.step) for s in validation_scalars(at, 2.0, math.exp(2.0))}
    assert set(valid) == {"lm-loss-validation/lm loss validation",
                          "lm-loss-validation/lm loss validation vs samples",
                          "lm-loss-validation/lm loss validation vs tokens"}
    assert valid["lm-loss-validation/lm loss validation vs samples"] == (2.0, 48)
    ppl = {s.tag for s in validation_scalars(at, 2.0, math.exp(2.0), log_ppl=True)}
    assert "lm-loss-validation/lm loss validation ppl vs tokens" in ppl


class FakeWandb(types.ModuleType):
    """Records what a run would send; reaches no network."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.metrics, self.finished = [], [], [], False

    def init(self, **kwargs):
        self.inits.append(kwargs)

    def log(self, values, step=None):
        self.logs.append((values, step))

    def define_metric(self, name, step_metric=None):
        self.metrics.append((name, step_metric))

    def finish(self):
        self.finished = True


def wandb_args(tmp_path, **kw):
    values = dict(wandb_project="moc", wandb_exp_name="run1", wandb_save_dir=None,
                  save=str(tmp_path / "ckpt"))
    values.update(kw)
    return Namespace(**values)


def test_wandb_gets_the_same_scalars_on_rank_0(monkeypatch, tmp_path):
    fake = FakeWandb()
    monkeypatch.setattr(wandb_log, "import_wandb", lambda: fake)
    args = wandb_args(tmp_path)
    assert wandb_log.open_wandb(args, rank=1) is None  # rank 0 only
    run = wandb_log.open_wandb(args, rank=0)
    assert fake.inits == [{"dir": str(tmp_path / "ckpt" / "wandb"), "name": "run1",
                           "project": "moc", "config": vars(args)}]
    assert (tmp_path / "ckpt" / "wandb").is_dir()
    writer = MetricsWriter(None, None, wandb=run)  # no TensorBoard: W&B alone
    assert writer.scalars_enabled
    writer.write("train", 3, {"lm_loss": 5.0}, scalars=train_scalars())
    writer.add_scalars(interval_scalars(Position(3, 24, 1536), {"lm loss": 5.0}, 0.5,
                                        {"samples_per_s": 1.0, "tokens_per_s": 64.0,
                                         "tgs": 32.0}, 2))
    writer.close()
    assert fake.finished
    assert ({"lm-loss-training/lm loss": 5.0}, 3) in fake.logs
    assert ({"lm-loss-training/lm loss vs samples": 5.0, "Samples": 24}, 3) in fake.logs
    assert ("lm-loss-training/lm loss vs tokens", "Tokens") in fake.metrics
    assert ({"throughput/samples_per_sec": 1.0}, 3) in fake.logs
    assert ({"loss/lm loss": 5.0}, 3) in fake.logs


def test_wandb_save_dir_flag(monkeypatch, tmp_path):
    fake = FakeWandb()
    monkeypatch.setattr(wandb_log, "import_wandb", lambda: fake)
    wandb_log.open_wandb(wandb_args(tmp_path, wandb_save_dir=str(tmp_path / "w"), save=None), 0)
    assert fake.inits[0]["dir"] == str(tmp_path / "w")


def test_wandb_missing_is_refused_naming_the_flag(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--wandb-project needs the wandb package "
                                          r"\(pip install wandb"):
        validate_args(parse_args(BASE + ["--wandb-project", "moc"]), world_size=1)
    monkeypatch.setattr(wandb_log, "import_wandb", lambda: None)  # the library entry too
    with pytest.raises(ConfigError, match="pip install wandb"):
        wandb_log.open_wandb(wandb_args(tmp_path), rank=0)


def test_wandb_companions_need_the_project():
    with pytest.raises(ConfigError, match="--wandb-exp-name needs --wandb-project"):
        validate_args(parse_args(BASE + ["--wandb-exp-name", "r"]), world_size=1)


def test_no_wandb_flag_no_run(monkeypatch, tmp_path):
    monkeypatch.setattr(wandb_log, "import_wandb", lambda: pytest.fail("imported"))
    assert wandb_log.open_wandb(wandb_args(tmp_path, wandb_project=None), rank=0) is None
    validate_args(parse_args(BASE), world_size=1)
