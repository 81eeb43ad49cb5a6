"""--fp16 and --bf16 on a device without them: every rank refuses before the process group,
naming the flag (or the --deepspeed_config key) and what the device runs instead.

Such a device is simulated: DeepSpeed's accelerator answers False for the missing types,
in this process (a stand-in accelerator) or in each rank (tests/training/precision_worker.py
patches the rank's accelerator object), as the CPU accelerator answers on a CPU whose
oneDNN has no float16 kernels."""

import json
import types

import pytest

from megatron.errors import ConfigError
from megatron.training.arguments import parse_args, validate_args
from megatron.training.precision import check_precision, supported_precisions
from tests.launch import run_ranks

TINY = ["--config", "configs/tiny.yaml", "--data-path", "unused"]
FP16_ON_CPU = ("--fp16 is not supported on this cpu device (DeepSpeed's cpu accelerator "
               "reports no fp16 support; torch's oneDNN has no float16 kernels for this CPU): "
               "use --bf16, or leave out --fp16 to train in fp32")
BF16_WITHOUT_FP16 = ("--bf16 is not supported on this cpu device (DeepSpeed's cpu accelerator "
                     "reports no bf16 support): leave out --bf16 to train in fp32 "
                     "(it has no fp16 either)")


def _accelerator(device="cpu", fp16=True, bf16=True):
    """DeepSpeed's accelerator as check_precision asks it (the CPU one answers None for
    "no" fp16)."""
    return types.SimpleNamespace(device_name=lambda: device,
                                 is_fp16_supported=lambda: True if fp16 else None,
                                 is_bf16_supported=lambda: bf16)


def _refusal(argv, **accelerator):
    args = validate_args(parse_args(TINY + argv), world_size=2)
    try:
        check_precision(args, _accelerator(**accelerator))
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("argv, accelerator, message", [
    (["--fp16"], {"fp16": False}, FP16_ON_CPU),
    (["--fp16"], {"fp16": False, "bf16": False},
     "--fp16 is not supported on this cpu device (DeepSpeed's cpu accelerator reports no fp16 "
     "support; torch's oneDNN has no float16 kernels for this CPU): leave out --fp16 to train "
     "in fp32 (it has no bf16 either)"),
    (["--bf16"], {"device": "cuda", "bf16": False},
     "--bf16 is not supported on this cuda device (DeepSpeed's cuda accelerator reports no "
     "bf16 support): use --fp16, or leave out --bf16 to train in fp32"),
    (["--bf16"], {"fp16": False, "bf16": False}, BF16_WITHOUT_FP16),
])
def test_a_missing_precision_is_refused_naming_the_flag_and_the_alternatives(
        argv, accelerator, message):
    assert _refusal(argv, **accelerator) == message


@pytest.mark.parametrize("argv, accelerator", [
    ([], {"fp16": False, "bf16": False}),  # fp32 runs anywhere
    (["--bf16"], {"fp16": False}),         # this CPU: bf16 but no fp16
    (["--fp16"], {"bf16": False}),
])
def test_a_supported_precision_passes(argv, accelerator):
    assert _refusal(argv, **accelerator) == ""


def test_a_deepspeed_config_file_enabling_fp16_is_named(tmp_path):
    """fp16 enabled by the file, not by a flag: the message names the file's key and
    says what to change there (--bf16 with the file's fp16 on would be refused too)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                "fp16": {"enabled": True}}))
    message = _refusal(["--deepspeed_config", str(path)], fp16=False)
    assert message == (
        f"fp16.enabled = true in --deepspeed_config {path} is not supported on this cpu "
        "device (DeepSpeed's cpu accelerator reports no fp16 support; torch's oneDNN has no "
        "float16 kernels for this CPU): enable bf16 there instead, or set fp16.enabled to "
        "false there to train in fp32")


def test_deepspeeds_own_answers_are_read():
    """On this machine's accelerator, whatever it supports: the answers are booleans, and
    a precision it has is not refused."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    supported = supported_precisions(accelerator)
    assert set(supported) == {"fp16", "bf16"}
    assert all(isinstance(ok, bool) for ok in supported.values())
    for dtype, ok in supported.items():
        if ok:
            check_precision(validate_args(parse_args(TINY + [f"--{dtype}"]), 2), accelerator)


@pytest.mark.parametrize("answers, flag, instead, started", [
    ("fp16=no,bf16=yes", "--fp16", "use --bf16, or leave out --fp16 to train in fp32", 2),
    ("fp16=no,bf16=no", "--bf16", "leave out --bf16 to train in fp32 (it has no fp16 either)", 2),
    # rank 0 of 2 alone: it refuses without waiting for a peer in the rendezvous
    ("fp16=no,bf16=yes", "--fp16", "use --bf16, or leave out --fp16 to train in fp32", 1),
])
def test_every_rank_refuses_before_the_process_group(answers, flag, instead, started):
    """Ranks of a 2-rank job of the trainer on a device that answers ``answers``: each
    prints the refusal and exits 2 (ConfigError's code); none waits for another."""
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().device_name()
    results = run_ranks(started, [answers] + TINY + [flag], env={"WORLD_SIZE": "2"},
                        script="tests/training/precision_worker.py", timeout=60)
    assert len(results) == started
    for r in results:
        assert r.returncode == ConfigError.exit_code == 2, r.output[-3000:]
        line = next((x for x in r.output.splitlines() if x.startswith("error: ")), "")
        assert line.startswith(f"error: {flag} is not supported on this {device} device ("), line
        assert line.endswith(f"): {instead}"), line
        assert "Traceback" not in r.output, r.output[-3000:]
