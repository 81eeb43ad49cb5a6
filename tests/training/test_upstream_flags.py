"""Megatron-DeepSpeed flags beyond its MoE example scripts: switches with nothing to switch
here (accepted, one line each on rank 0), options this trainer does not have (refused,
saying what to do), separate datasets; unknown flags; ``--help`` without torch."""

import json

import pytest

from megatron.errors import ConfigError
from megatron.training.arguments import parse_args, validate_args
from megatron.training.megatron_compat import ignored_flag_notes
from tests.launch import fresh_python

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3"]
DATA = ["--data-path", "some/prefix"]

SWITCHES = {  # flag(s) -> what its line says
    ("--distributed-backend", "gloo"): "the backend is DeepSpeed's accelerator's",
    ("--use-flash-attn",): "attention always runs in torch's scaled_dot_product_attention",
    ("--use-flash-attn-v2",): "attention always runs in torch's scaled_dot_product_attention",
    ("--no-gradient-accumulation-fusion",): "gradient accumulation is never fused",
    ("--no-masked-softmax-fusion",): "not Megatron's fused scale-mask-softmax kernel",
    ("--no-bias-gelu-fusion",): "nothing to switch off here (no fused kernel)",
    ("--no-bias-dropout-fusion",): "nothing to switch off here (no fused kernel)",
    ("--use-cpu-initialization",): "weights are always initialized on the CPU",
}


def test_switches_with_nothing_to_switch_are_accepted_with_a_line_each():
    """One line per switch, saying why it changes nothing (the trainer prints them on rank
    0 once: tests/training/test_pretrain.py::test_torchrun_launch)."""
    argv = BASE + DATA + [token for flags in SWITCHES for token in flags]
    lines = ignored_flag_notes(validate_args(parse_args(argv), world_size=1))
    assert len(lines) == len(SWITCHES), lines
    for (flag, *_), says in SWITCHES.items():
        line = next(line for line in lines if line.startswith(f"{flag}"))
        assert says in line and line.endswith("ignored"), line


def test_flash_attention_line_says_when_the_math_kernel_runs():
    args = validate_args(parse_args(BASE + DATA + ["--use-flash-attn-v2", "--deterministic"]), 1)
    assert "--deterministic (implied there by --moc-mode exact) restricts it to the math " \
           "kernel" in ignored_flag_notes(args)[0]


def test_options_that_describe_this_model_pass_silently():
    args = validate_args(parse_args(BASE + DATA + [
        "--mlp-type", "standard", "--normalization", "layernorm", "--num-key-value-heads", "4",
        "--rotary-percent", "1.0", "--position-embedding-type", "rope"]), world_size=1)
    assert ignored_flag_notes(args) == []


@pytest.mark.parametrize("extra, needle", [
    (["--num-key-value-heads", "3"], "--num-key-value-heads (3) must divide "
                                     "--num-attention-heads (4)"),
    (["--group-query-attention"], "--group-query-attention: not supported: this is "
                                  "Megatron-LM's switch"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5: not supported yet"),
    (["--mlp-type", "residual"], "--mlp-type residual: Residual MoE (PR-MoE's"),
    (["--rampup-batch-size", "16", "8", "300000"],
     "--rampup-batch-size 16 8 300000: batch-size ramp-up is not supported"),
])
def test_options_this_trainer_does_not_have_are_refused(extra, needle):
    with pytest.raises(ConfigError) as err:
        validate_args(parse_args(BASE + DATA + extra), world_size=1)
    assert needle in str(err.value)


def test_a_refused_option_exits_2_before_any_process_group(monkeypatch, capsys):
    import pretrain_gpt_moe
    from megatron.training import training

    def no_process_group(args):
        raise AssertionError("the process group was being created: --rotary-percent passed")

    monkeypatch.setattr(training, "initialize_distributed", no_process_group)
    assert pretrain_gpt_moe.main(BASE + DATA + ["--rotary-percent", "0.5"]) == 2
    assert capsys.readouterr().err.startswith("error: --rotary-percent 0.5: not supported yet")


@pytest.mark.parametrize("extra, needle", [
    ([], "--data-path is required (a flag, or the key 'data-path' in --config), or "
         "--train-data-path"),
    (DATA + ["--train-data-path", "t"], "--data-path and --train-data-path both name the data"),
    (["--valid-data-path", "v"], "--valid-data-path needs --train-data-path"),
])
def test_one_source_of_data(extra, needle):
    with pytest.raises(ConfigError) as err:
        validate_args(parse_args(BASE + extra), world_size=1)
    assert needle in str(err.value)


def test_split_beside_separate_datasets_is_noted():
    args = validate_args(parse_args(BASE + ["--train-data-path", "t", "--valid-data-path", "v",
                                            "--split", "98,2,0"]), world_size=1)
    assert (args.train_data_path, args.valid_data_path) == (["t"], ["v"])
    assert ignored_flag_notes(args) == [
        "--split 98,2,0: --train-data-path (--valid-data-path, --test-data-path) each name a "
        "dataset used whole, as in Megatron-DeepSpeed, which ignores --split with them too; "
        "ignored"]


def test_the_flags_work_as_yaml_keys(tmp_path):
    cfg = tmp_path / "upstream.yaml"
    cfg.write_text("distributed-backend: nccl\nuse-flash-attn-v2: true\nmlp-type: standard\n")
    args = parse_args(["--config", str(cfg)] + BASE + DATA)
    assert (args.distributed_backend, args.use_flash_attn_v2, args.mlp_type) == \
        ("nccl", True, "standard")


def test_an_unknown_flag_names_the_closest_and_where_every_flag_is():
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + DATA + ["--num-layerz", "3"])
    assert str(err.value) == ("unrecognized arguments: --num-layerz 3; --num-layerz: did you "
                              "mean --num-layers? (every flag: pretrain_gpt_moe.py --help, or "
                              "docs/flags.md)")


HELP = """
import contextlib, io, json, runpy, sys
sys.argv = ["pretrain_gpt_moe.py", "--help"]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        runpy.run_path("pretrain_gpt_moe.py", run_name="__main__")
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "help": out.getvalue(),
                  "heavy": sorted(m for m in ("torch", "deepspeed") if m in sys.modules)}))
"""


def test_help_shows_defaults_without_importing_torch_or_deepspeed():
    """``--help`` answers without the seconds torch and DeepSpeed take to import."""
    result = json.loads(fresh_python(HELP)[-1])
    assert result["code"] == 0 and result["heavy"] == [], result["heavy"]
    text = " ".join(result["help"].split())  # argparse wraps lines
    assert "--seed SEED Seed of init, dropout and data order. (default: 1234)" in text
    assert "--moc-pec-policy {sequential,load-aware}" in text
    assert "(default: None)" not in text and "(default: False)" not in text
