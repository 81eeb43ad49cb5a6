"""Megatron-DeepSpeed's MoE example scripts (examples/megatron_deepspeed/, scaled down):
their argument lists parse and validate, the flags that restate what we do accept only
the value we support, a --deepspeed_config file may not contradict a flag, PR-MoE is
refused by name, and one script trains end to end on 2 ranks with --moc-checkpoint: in
upstream's fp16 where DeepSpeed's accelerator has it, else in bf16 or fp32 (PRECISION=),
with the fp16-only checks skipped and the reason given."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import sysconfig

import pytest

from megatron.errors import ConfigError
from megatron.training.arguments import parse_args, validate_args
from megatron.training.ds_config import build_ds_config
from tests.data.test_tokenizer import write_gpt2_files
from tests.launch import REPO, free_port
from tests.precision import missing_reason, skip_without

EXAMPLES = os.path.join(REPO, "examples", "megatron_deepspeed")
SCRIPTS = ["ds_pretrain_gpt_125M_MoE64.sh", "ds_pretrain_gpt_350M_MoE128.sh",
           "ds_pretrain_gpt_1.3B_MoE128.sh"]
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--data-path", "some/prefix"]


def _script_env(out, data="data/prefix", vocab="vocab.json", merges="merges.txt", **extra):
    env = dict(os.environ, OUTPUT_BASEPATH=str(out), DATA_PATH=str(data), VOCAB_PATH=str(vocab),
               MERGE_PATH=str(merges), PYTHON=sys.executable,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.update(extra)
    return env


def script_argv(script, out, **env):
    """The argument list the example script passes to the trainer."""
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, script)], capture_output=True,
                          text=True, env=_script_env(out, MOC_PRINT_ARGS="1", **env), timeout=60,
                          check=True)
    return proc.stdout.split()


@pytest.fixture
def tensorboard_importable(monkeypatch):
    """validate_args refuses --tensorboard-dir without the package: pretend it is there."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "tensorboard" else real(name, *a))


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_scripts_parse_and_validate(script, tmp_path, tensorboard_importable):
    argv = script_argv(script, tmp_path, TENSORBOARD="true")
    for flag in ("--tensor-model-parallel-size", "--data-impl", "--train-tokens",
                 "--lr-warmup-tokens", "--lr-decay-tokens", "--exit-duration-in-mins",
                 "--checkpoint-activations", "--deepspeed-activation-checkpointing",
                 "--pipeline-model-parallel-size", "--no-pipeline-parallel", "--hysteresis",
                 "--create-moe-param-group", "--override-opt_param-scheduler",
                 "--tensorboard-queue-size", "--log-timers-to-tensorboard",
                 "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                 "--fp16", "--moc-checkpoint"):
        assert flag in argv, flag
    args = validate_args(parse_args(argv), world_size=2)
    assert args.tokenizer_type == "GPT2BPETokenizer"  # from --vocab-file/--merge-file
    assert (args.fp16, args.zero_stage, args.clip_grad, args.hysteresis) == (True, 1, 1.0, 2)
    assert args.train_tokens == 4 * args.global_batch_size * args.seq_length
    assert args.train_iters == 3 * 4  # upstream's formula: 3x the iterations of the tokens
    assert args.num_experts > args.moe_expert_parallel_size == 2
    config = build_ds_config(args)
    assert "curriculum_learning" not in config  # upstream's disabled legacy section dropped
    assert config["fp16"]["enabled"] is True and config["zero_optimization"]["stage"] == 1


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_precision_switches_the_flag_and_the_config_sections(script, precision, tmp_path):
    """PRECISION=bf16/fp32, for a device without fp16: the flag and the DeepSpeed config's
    fp16/bf16 sections change together (a file left at fp16 would be refused as a
    conflict), nothing else does."""
    fp16_argv = script_argv(script, tmp_path / "fp16", TENSORBOARD="false")
    argv = script_argv(script, tmp_path, PRECISION=precision, TENSORBOARD="false")
    assert "--fp16" not in argv and ("--bf16" in argv) == (precision == "bf16")
    assert ([a for a in fp16_argv if a != "--fp16"]
            == [a.replace(str(tmp_path), str(tmp_path / "fp16")) for a in argv if a != "--bf16"])
    args = validate_args(parse_args(argv), world_size=2)
    assert (args.fp16, args.bf16) == (False, precision == "bf16")
    config = build_ds_config(args)
    assert config["fp16"]["enabled"] is False
    assert config["bf16"]["enabled"] is (precision == "bf16")


def test_an_unknown_precision_is_refused_by_the_script(tmp_path):
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, SCRIPTS[0])], capture_output=True,
                          text=True, env=_script_env(tmp_path, PRECISION="fp8"), timeout=60)
    assert proc.returncode == 2
    assert "PRECISION must be fp16, bf16 or fp32, not fp8" in proc.stderr


def _ds_file(tmp_path, **sections):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "gradient_clipping": 1.0, "fp16": {"enabled": True, "hysteresis": 2}}
    config.update(sections)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return ["--deepspeed_config", str(path)]


@pytest.mark.parametrize("extra, needle", [
    (["--tensor-model-parallel-size", "2", "--num-experts", "4"],
     "experts replicated over the tensor-parallel ranks (no --enable-expert-tensor-parallelism) "
     "need --moe-expert-parallel-size (1) to be a multiple of --tensor-model-parallel-size (2)"),
    (["--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism",
      "--sequence-parallel"],
     "--sequence-parallel: sequence parallelism is not supported yet"),
    (["--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size 2 with --zero-stage 2: DeepSpeed's pipeline engine"),
    (["--data-impl", "lazy"], "argument --data-impl: invalid choice: 'lazy' (choose from mmap, infer)"),
    (["--num-experts", "32", "32", "64"],
     "--num-experts 32 32 64: PR-MoE (per-layer expert counts) is not supported"),
    (["--hysteresis", "0"], "--hysteresis must be >= 1"),
    (["--tensorboard-queue-size", "0"], "--tensorboard-queue-size must be >= 1"),
    (["--train-tokens", "0"], "--train-tokens must be >= 1"),
    (["--lr-warmup-tokens", "64", "--lr-decay-tokens", "64"],
     "--lr-warmup-tokens (64) must be smaller than --lr-decay-tokens (64)"),
    (["--lr-warmup-tokens", "64", "--lr-warmup-iters", "1"], "give one"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0"),
    (["--vocab-file", "v.json", "--tokenizer-type", "ByteLevelTokenizer"],
     "--vocab-file given with --tokenizer-type ByteLevelTokenizer"),
])
def test_unsupported_values_are_refused_by_name(extra, needle):
    with pytest.raises(ConfigError) as err:
        validate_args(parse_args(BASE + extra), world_size=2)
    assert needle in str(err.value).replace("'mmap', 'infer'", "mmap, infer")


@pytest.mark.parametrize("flags, sections, needle", [
    (["--zero-stage", "2"], {}, "--zero-stage 2 conflicts with zero_optimization.stage = 1"),
    (["--clip-grad", "0.5"], {}, "--clip-grad 0.5 conflicts with gradient_clipping = 1.0"),
    (["--bf16"], {"fp16": {"enabled": False}, "bf16": {"enabled": False}},
     "--bf16 conflicts with bf16.enabled = false"),
    (["--bf16"], {}, "enables both fp16 and bf16"),
    (["--hysteresis", "4"], {}, "--hysteresis 4 conflicts with fp16.hysteresis = 2"),
    (["--fp16"], {"fp16": {"enabled": False}}, "--fp16 conflicts with fp16.enabled = false"),
    (["--moc-checkpoint"], {"zero_optimization": {"stage": 0}},
     "has ZeRO stage 0 with fp16: set zero_optimization.stage to 1 or 2 there"),
    ([], {"zero_optimization": {"stage": 3}}, "zero_optimization.stage = 3"),
    ([], {"curriculum_learning": {"enabled": True}}, "curriculum learning is not supported"),
])
def test_deepspeed_config_file_may_not_contradict_a_flag(tmp_path, flags, sections, needle):
    with pytest.raises(ConfigError) as err:
        args = validate_args(parse_args(BASE + flags + _ds_file(tmp_path, **sections)), 2)
        build_ds_config(args)
    assert needle in str(err.value)
    assert "ds.json" in str(err.value)


def test_deepspeed_config_file_fills_the_flags_not_given(tmp_path):
    args = validate_args(parse_args(BASE + _ds_file(tmp_path)), world_size=2)
    assert (args.fp16, args.zero_stage, args.clip_grad) == (True, 1, 1.0)
    args = validate_args(parse_args(BASE + ["--clip-grad", "1.0", "--loss-scale", "128"]
                                    + _ds_file(tmp_path, gradient_clipping=None)), 2)
    config = build_ds_config(args)
    assert config["fp16"]["loss_scale"] == 128.0  # a given flag the file leaves out counts
    # Without a file the built config carries --hysteresis.
    args = validate_args(parse_args(BASE + ["--fp16", "--hysteresis", "5"]), world_size=2)
    assert build_ds_config(args)["fp16"]["hysteresis"] == 5


def test_vocab_and_merge_files_select_gpt2_bpe():
    args = validate_args(parse_args(BASE + ["--vocab-file", "v.json", "--merge-file", "m.txt"]), 1)
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert validate_args(parse_args(BASE), 1).tokenizer_type == "ByteLevelTokenizer"


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    """A GPT-2 BPE vocabulary (the small one of the tokenizer tests) and standard-library
    sources preprocessed with it, as the scripts' --vocab-file/--merge-file expect."""
    out = tmp_path_factory.mktemp("bpe_corpus")
    vocab, merges = write_gpt2_files(out / "tokenizer")
    prefix = str(out / "stdlib")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
                    "--input", sysconfig.get_paths()["stdlib"], "--input-ext", ".py",
                    "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
                    # 60 documents: --split 98,2,0 leaves one for validation
                    "--workers", "1", "--max-documents", "60",
                    "--exclude-dirs", "site-packages", "dist-packages"],
                   check=True, cwd=REPO, capture_output=True, text=True)
    return prefix + "_text_document", vocab, merges


def _precision_here() -> str:
    """The precision the 125M run trains in here: upstream's fp16 where this machine has
    it, else bf16, else fp32 (the trainer refuses what the device lacks)."""
    if not missing_reason("fp16"):
        return "fp16"
    return "fp32" if missing_reason("bf16") else "bf16"


@pytest.fixture(scope="module")
def script_run(bpe_corpus, tmp_path_factory):
    """The scaled 125M script run once on 2 ranks (PRECISION as :func:`_precision_here`
    picks): the precision, the launcher's exit code and output, the training log and the
    output directory."""
    data, vocab, merges = bpe_corpus
    precision = _precision_here()
    out = tmp_path_factory.mktemp("script_125M")
    env = _script_env(out, data, vocab, merges, MASTER_PORT=str(free_port()),
                      TENSORBOARD="false", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                      PYTHONPATH=REPO, PRECISION=precision)
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, SCRIPTS[0])], capture_output=True,
                          text=True, env=env, timeout=300)
    logs = list((out / "log").iterdir())
    log = logs[0].read_text() if logs else ""
    return precision, proc, log, out


def _loss_scales(log):
    return [float(x) for x in re.findall(r"loss scale: (\S+) \|", log)]


def test_the_125M_script_trains_on_two_ranks_with_moc(script_run):
    """The one multi-rank run: the scaled 125M script, token schedule and token stop,
    activation checkpointing, --exit-duration-in-mins's all-reduce every iteration, MoC
    checkpoints; in fp16 where the device has it, else in bf16 or fp32 (the next test
    checks what only fp16 has)."""
    precision, proc, log, out = script_run
    assert proc.returncode == 0, proc.stdout[-2000:] + log[-5000:]
    assert "training from iteration 0 to 12 or 1024 tokens" in log
    assert "training done at iteration 4 (32 samples)" in log  # --train-tokens stopped it
    assert re.search(rf"ZeRO stage 1, .*, {precision}\n", log), log[-3000:]
    assert "MoC checkpointing on" in log
    lrs = [float(x) for x in re.findall(r"learning rate: (\S+) \|", log)]
    assert lrs[0] == pytest.approx(4.5e-4)   # warm-up: 256 tokens, one iteration
    assert lrs[-1] == pytest.approx(4.5e-6)  # decayed to --min-lr at 1024 tokens
    if precision != "fp16":  # ZeRO's optimizer logs a scale of 1 without fp16
        assert _loss_scales(log) == [1.0] * 4, log[-3000:]
    ckpt = next((out / "checkpoint").iterdir())
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    assert (ckpt / "global_step4" / "manifest.json").exists()


def test_the_125M_script_trains_in_upstreams_fp16(script_run):
    """Upstream's precision: fp16 with its config's dynamic loss scale, 2^11 at first
    (hysteresis 2: one overflow does not lower it yet)."""
    precision, proc, log, _ = script_run
    skip_without("fp16", f"the test above trained the 125M script in {precision} "
                 f"(PRECISION={precision}) and checked the rest")
    assert proc.returncode == 0, proc.stdout[-2000:] + log[-5000:]
    scales = _loss_scales(log)
    assert len(scales) == 4 and scales[0] == 2048.0, log[-3000:]
    assert all(1.0 < s <= 2048.0 and math.log2(s).is_integer() for s in scales), scales
