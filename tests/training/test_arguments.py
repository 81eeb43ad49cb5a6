"""Flags, YAML configs, precedence and the bad-input checks of validate_args."""

import os
import re
import textwrap

import pytest

from megatron.errors import ConfigError
from megatron.training.arguments import build_parser, parse_args, padded_vocab_size, validate_args
from megatron.training.ds_config import build_ds_config
from tests.launch import REPO

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--data-path", "some/prefix"]


def _yaml(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_yaml_values_are_used_and_flags_win(tmp_path):
    cfg = _yaml(tmp_path, """
        num-layers: 6
        hidden_size: 64          # underscores work too
        num-experts: 8
        bf16: true
        data-path: [0.3, a, 0.7, b]
        """)
    args = parse_args(["--config", cfg, "--num-layers", "3"])
    assert args.num_layers == 3            # flag beats YAML
    assert args.hidden_size == 64
    assert args.num_experts == 8
    assert args.bf16 is True
    assert args.data_path == ["0.3", "a", "0.7", "b"]


def test_later_config_file_wins_and_sections_flatten(tmp_path):
    first = _yaml(tmp_path, "num-layers: 6\nlr: 0.1\n", "a.yaml")
    second = _yaml(tmp_path, "lr: 0.5\nlr-decay:\n  style: cosine\n", "b.yaml")
    args = parse_args(["--config", first, "--config", second])
    assert (args.num_layers, args.lr, args.lr_decay_style) == (6, 0.5, "cosine")


@pytest.mark.parametrize("text, needle", [
    ("num-layer: 2\n", "unknown key 'num-layer'"),
    ("num-layers: two\n", "invalid int value"),
    ("bf16: 3\n", "must be true or false"),
    ("- a\n- b\n", "must hold a mapping"),
])
def test_bad_yaml_names_the_key_and_file(tmp_path, text, needle):
    cfg = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", cfg])
    assert needle in str(err.value)
    assert "c.yaml" in str(err.value)


def test_unknown_flag_and_missing_file():
    with pytest.raises(ConfigError, match="unrecognized arguments: --num-layerz"):
        parse_args(BASE + ["--num-layerz", "3"])
    with pytest.raises(ConfigError, match="--config: file not found: nope.yaml"):
        parse_args(["--config", "nope.yaml"])


def test_derived_values():
    args = validate_args(parse_args(BASE + ["--global-batch-size", "16"]), world_size=4)
    assert args.data_parallel_size == 4
    assert args.gradient_accumulation_steps == 2
    assert args.max_position_embeddings == 16
    assert args.lr_decay_iters == 4
    cfg = build_ds_config(args)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"],
            cfg["gradient_accumulation_steps"]) == (16, 2, 2)
    assert cfg["zero_optimization"]["stage"] == 2


TWO_LEVEL = ["--moc-checkpoint", "--moc-two-level", "--save", "ck", "--num-experts", "12",
             "--moe-expert-parallel-size", "1"]


@pytest.mark.parametrize("extra, world, needle", [
    (["--num-experts", "6", "--moe-expert-parallel-size", "4"], 4,
     "--num-experts (6) must be divisible by --moe-expert-parallel-size (4)"),
    (["--num-experts", "4", "--moe-expert-parallel-size", "4"], 6,
     "world size (6) must be divisible by --moe-expert-parallel-size (4)"),
    (["--global-batch-size", "6"], 2, "--global-batch-size (6) must be divisible by"),
    (["--bf16", "--fp16"], 1, "mutually exclusive"),
    (["--hidden-size", "30"], 1, "--hidden-size (30) must be divisible by --num-attention-heads"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "--seq-length (64) exceeds"),
    (["--min-lr", "1"], 1, "--min-lr"),
    (["--deepspeed_config", "missing.json"], 1, "--deepspeed_config: file not found"),
    (["--save", "s3://bucket/run"], 1, "--save s3://bucket/run: storage URLs need --moc-checkpoint"),
    (["--moc-checkpoint", "--load", "nosuchproto://bucket/run"], 1, "--load: nosuchproto://bucket/run"),
    (["--moc-checkpoint", "--moc-two-level", "--save", "ck", "--moc-pec-scope", "w"], 1,
     "--moc-pec-scope w is not supported with --moc-two-level"),
    (["--moc-checkpoint", "--save", "ck", "--moc-redundancy", "replicate"], 2,
     "--moc-redundancy replicate protects two-level snapshots: add --moc-two-level"),
    (TWO_LEVEL + ["--moc-redundancy", "replicate", "--moc-replicas", "2",
                  "--moc-ranks-per-node", "2"], 4,
     "--moc-replicas 2 needs at least 3 nodes, the job has 2"),
    (TWO_LEVEL + ["--moc-redundancy", "erasure", "--moc-ranks-per-node", "1"], 4,
     "groups nodes by 3; the job has 4 node(s)"),
    (TWO_LEVEL + ["--moc-redundancy", "erasure", "--moc-ec-parity", "2"], 3,
     "--moc-ec-parity 2 is not supported"),
    (TWO_LEVEL + ["--moc-redundancy", "replicate", "--moc-ranks-per-node", "3"], 4,
     "4 ranks do not split into nodes of 3 (--moc-ranks-per-node)"),
    (TWO_LEVEL + ["--moc-redundancy", "replicate", "--moc-redundancy-interval", "0"], 2,
     "--moc-redundancy-interval must be >= 1"),
    (["--moc-checkpoint", "--save", "ck", "--moc-fault", "lose-memory@2:rank=1"], 2,
     "--moc-fault lose-memory needs in-memory snapshots"),
    (["--save", "ck", "--moc-fault", "persist-crash@2"], 1,
     "--moc-fault persist-crash needs --moc-two-level"),
    (["--save", "ck", "--moc-fault", "snapshot-crash@2"], 1,
     "--moc-fault snapshot-crash needs --moc-two-level"),
])
def test_validation_names_the_flag(extra, world, needle):
    with pytest.raises(ConfigError) as err:
        validate_args(parse_args(BASE + extra), world_size=world)
    assert needle in str(err.value)


def test_required_flag_is_named():
    with pytest.raises(ConfigError, match="--train-iters is required"):
        i = BASE.index("--train-iters")
        validate_args(parse_args(BASE[:i] + BASE[i + 2:]), 1)


def test_deepspeed_config_file_must_agree(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 99, "zero_optimization": {"stage": 1}}')
    args = validate_args(parse_args(BASE + ["--deepspeed_config", str(ds)]), world_size=2)
    with pytest.raises(ConfigError, match="train_batch_size is 99 but the flags give 4"):
        build_ds_config(args)
    ds.write_text('{"zero_optimization": {"stage": 1}}')
    cfg = build_ds_config(args)
    assert cfg["train_batch_size"] == 4 and cfg["zero_optimization"]["stage"] == 1


def test_tensor_and_pipeline_parallelism_send_whole_activations(tmp_path):
    """With T and P > 1, DeepSpeed's pipeline engine would split what a stage sends over
    the tensor-parallel ranks (its default), which it does not support with MoE: the
    config sets it off, and a --deepspeed_config file that sets it on is refused by
    key. Without tensor parallelism the section is left alone."""
    flags = BASE + ["--num-experts", "2", "--pipeline-model-parallel-size", "2",
                    "--zero-stage", "1"]
    assert "pipeline" not in build_ds_config(validate_args(parse_args(flags), world_size=2))
    flags += ["--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism"]
    cfg = build_ds_config(validate_args(parse_args(flags), world_size=4))
    assert cfg["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 1}, "pipeline": {"grad_partitioned": true}}')
    args = validate_args(parse_args(flags + ["--deepspeed_config", str(ds)]), world_size=4)
    with pytest.raises(ConfigError, match=r"pipeline.grad_partitioned = true in --deepspeed_config "
                                          r".*ds.json: .* set it false"):
        build_ds_config(args)


def test_padded_vocab():
    assert padded_vocab_size(257, 128) == 384
    assert padded_vocab_size(256, 128) == 256


def test_tensorboard_dir_without_tensorboard_is_refused_on_every_rank(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="--tensorboard-dir needs the tensorboard package"):
        validate_args(parse_args(BASE + ["--tensorboard-dir", "tb"]), world_size=1)


def test_checkpoint_policy_fragments_compose_with_a_model_config():
    args = parse_args(["--config", "configs/small.yaml", "--config",
                       "configs/checkpoint/moc-pec.yaml", "--data-path", "x"])
    assert (args.moc_checkpoint, args.moc_pec_k, args.moc_pec_policy, args.moc_keep) == \
        (True, 1, "sequential", 3)
    assert args.num_experts == 8 and args.save_interval == 50
    validate_args(args, world_size=2)
    with pytest.raises(ConfigError, match="--moc-pec-k \\(9\\) exceeds --num-experts \\(8\\)"):
        validate_args(parse_args(["--config", "configs/small.yaml", "--data-path", "x",
                                  "--moc-pec-k", "9"]), world_size=2)


def test_an_output_file_that_cannot_be_created_is_refused_on_every_rank(tmp_path):
    """--metrics-file/--moc-event-file are opened by rank 0 after loading: one that cannot
    be created must stop every rank here (exit 2, the flag named), not rank 0 alone later
    while the others wait in a collective."""
    (tmp_path / "a-file").write_text("")
    for flag in ("--metrics-file", "--moc-event-file"):
        with pytest.raises(ConfigError, match=f"{flag} {tmp_path} is a directory"):
            validate_args(parse_args(BASE + [flag, str(tmp_path)]), world_size=1)
        bad = str(tmp_path / "a-file" / "m.jsonl")
        with pytest.raises(ConfigError, match=f"{flag} {bad}: cannot create it"):
            validate_args(parse_args(BASE + [flag, bad]), world_size=1)
        fine = str(tmp_path / "new" / "dir" / "m.jsonl")  # created when first written
        validate_args(parse_args(BASE + [flag, fine]), world_size=1)


# Bad numbers that crashed with a traceback (NaN/inf into timedelta or MoCConfig), hung
# (an infinite --moc-commit-timeout in the shutdown barrier, an endless slow fault) or
# failed later on one rank (a keeper socket path too long to bind) on the old code.
MOC = ["--moc-checkpoint", "--save", "ck", "--num-experts", "4"]
EXACT = MOC + ["--moc-mode", "exact"]
LONG_DIR = "/tmp/" + "d" * 84  # 89 bytes: "<dir>/node9/keeper.sock" is 107 bytes, node10's 108


BAD_NUMBERS = [
    (MOC + ["--moc-k-persist", "-1"], 1, "--moc-k-persist must be >= 0"),
    (MOC + ["--moc-k-persist", "5"], 1, "--moc-k-persist (5) exceeds --num-experts (4)"),
    (TWO_LEVEL + ["--moc-k-snapshot", "-1"], 1, "--moc-k-snapshot must be >= 0"),
    (TWO_LEVEL + ["--moc-ranks-per-node", "-2"], 2, "--moc-ranks-per-node must be >= 0"),
    (["--distributed-timeout-minutes", "nan"], 1,
     "--distributed-timeout-minutes must be a finite number of minutes > 0, got nan"),
    (["--distributed-timeout-minutes", "inf"], 1, "--distributed-timeout-minutes must be a finite"),
    (["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes must be a finite"),
    (["--distributed-timeout-minutes", "-1"], 1, "--distributed-timeout-minutes must be a finite"),
    (["--distributed-timeout-minutes", "1e20"], 1, "--distributed-timeout-minutes must be at most"),
    (EXACT + ["--moc-expected-mtbf", "nan"], 1,
     "--moc-expected-mtbf must be a finite number of seconds >= 0 (0: unknown), got nan"),
    (EXACT + ["--moc-expected-mtbf", "inf"], 1, "--moc-expected-mtbf must be a finite"),
    (MOC + ["--moc-commit-timeout", "inf"], 1,
     "--moc-commit-timeout must be a finite number of seconds > 0, got inf"),
    (MOC + ["--moc-commit-timeout", "1e300"], 1, "--moc-commit-timeout must be at most"),
    (TWO_LEVEL + ["--moc-host-memory-gb", "nan"], 1, "--moc-host-memory-gb must be a finite"),
    (TWO_LEVEL + ["--moc-host-memory-gb", "inf"], 1, "--moc-host-memory-gb must be a finite"),
    (TWO_LEVEL + ["--moc-host-memory-gb", "-1"], 1, "--moc-host-memory-gb must be a finite"),
    (["--moc-monitor", "--moc-hang-timeout", "inf"], 1, "--moc-hang-timeout must be a finite"),
    (["--save", "ck", "--moc-fault-mtbf", "inf"], 1, "--moc-fault-mtbf must be a finite"),
    (["--save", "ck", "--moc-fault", "slow@2:slow=inf"], 1,
     "--moc-fault slow@2:rank=0:slow=inf: slow must be a finite number of seconds"),
    (["--moc-monitor", "--moc-straggler-factor", "inf"], 1,
     "--moc-straggler-factor must be a finite number, got inf"),
    (["--clip-grad", "nan"], 1, "--clip-grad must be a finite number, got nan"),
    (TWO_LEVEL + ["--moc-shm-dir", "/tmp/" + "s" * 100], 1,
     f"--moc-shm-dir /tmp/{'s' * 100} is too long: the keeper of node 0 would listen on "
     f"/tmp/{'s' * 100}/node0/keeper.sock, 123 bytes, and a Unix socket path holds at most 107"),
    (TWO_LEVEL + ["--moc-shm-dir", LONG_DIR, "--moc-ranks-per-node", "1"], 11,
     "the keeper of node 10 would listen on"),
    (EXACT + ["--moc-shm-dir", LONG_DIR, "--moc-ranks-per-node", "2"], 22,
     "--moc-shm-dir /tmp/ddd"),
]


def _case_id(extra, world):
    for prefix, name in ((EXACT, "exact"), (MOC, "moc"), (TWO_LEVEL, "two-level")):
        if extra[:len(prefix)] == prefix:
            extra = [name] + extra[len(prefix):]
    return " ".join(a if len(a) < 30 else a[:8] + "..." for a in extra) + f" world={world}"


@pytest.mark.parametrize("extra, world, needle", BAD_NUMBERS,
                         ids=[_case_id(extra, world) for extra, world, _ in BAD_NUMBERS])
def test_bad_number_exits_2_naming_the_flag_before_any_process_group(monkeypatch, capsys,
                                                                        extra, world, needle):
    """The entry point prints ``error: <message naming the flag>`` and exits 2, on every
    rank, before the process group exists (creating it here fails the test)."""
    import pretrain_gpt_moe
    from megatron.training import training

    def no_process_group(args):
        raise AssertionError("the process group was being created: the bad value passed")

    monkeypatch.setattr(training, "initialize_distributed", no_process_group)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert pretrain_gpt_moe.main(BASE + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --"), err
    assert needle in err, err


def test_sensible_numbers_and_shm_dirs_still_pass(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for extra, world in [
        (MOC + ["--moc-k-persist", "0", "--moc-commit-timeout", "0.5",
                "--distributed-timeout-minutes", "0.5"], 1),
        (EXACT + ["--moc-expected-mtbf", "0", "--moc-host-memory-gb", "0"], 1),
        (EXACT + ["--moc-expected-mtbf", "3600", "--moc-host-memory-gb", "1.5"], 1),
        (TWO_LEVEL + ["--moc-ranks-per-node", "0", "--moc-k-snapshot", "0"], 2),
        (TWO_LEVEL + ["--moc-shm-dir", LONG_DIR, "--moc-ranks-per-node", "1"], 10),  # node9: 107
        (["--save", "ck", "--moc-fault", "slow@2:slow=1.5", "--moc-fault-mtbf", "60"], 1),
        (["--moc-monitor", "--moc-hang-timeout", "60", "--moc-monitor-poll", "1"], 1),
    ]:
        validate_args(parse_args(BASE + extra), world_size=world)


def test_keeper_socket_path_limit_is_the_keepers():
    """The keeper owns its socket's path and limit (deepspeed_ext imports no trainer, so
    it raises its own ValueError); validate_args turns it into a ConfigError, above."""
    from deepspeed_ext.keeper import SUN_PATH_MAX
    from deepspeed_ext.keeper.paths import (SocketPathTooLong, check_keeper_socket_path,
                                            keeper_socket_path, node_directory)
    assert SUN_PATH_MAX == 107
    assert node_directory("/dev/shm/x", 12) == "/dev/shm/x/node12"
    assert keeper_socket_path("/dev/shm/x", 12) == "/dev/shm/x/node12/keeper.sock"
    check_keeper_socket_path(LONG_DIR, 9)
    with pytest.raises(SocketPathTooLong,
                       match="108 bytes, and a Unix socket path holds at most 107"):
        check_keeper_socket_path(LONG_DIR, 10)
    assert issubclass(SocketPathTooLong, ValueError)


FLAG_ROW = re.compile(r"^\| (`--[^|]+`) \| ([^|]*) \| (.*) \|$")


def _doc_default(action) -> str:
    """How docs/flags.md writes a flag's default: `off` for a switch, nothing for no value."""
    if action.nargs == 0 and isinstance(action.default, bool):
        return "`off`"
    return "" if action.default in (None, []) else f"`{action.default}`"


def test_flags_page_shows_each_default_and_choice_of_the_parser():
    """docs/flags.md's default column is the parser's, and a flag with a fixed set of values
    names each of them (test_readme checks that every flag has a row)."""
    rows = {}
    with open(os.path.join(REPO, "docs", "flags.md")) as f:
        for line in f:
            match = FLAG_ROW.match(line.rstrip("\n"))
            for flag in re.findall(r"`(--[^`]+)`", match.group(1)) if match else ():
                rows[flag] = (match.group(2).strip(), line)
    wrong = []
    for action in build_parser()._actions:
        flag = action.option_strings[-1] if action.option_strings else None
        if flag in (None, "--help") or flag not in rows:
            continue
        default, line = rows[flag]
        if default != _doc_default(action):
            wrong.append(f"{flag}: default {default!r}, the parser's {_doc_default(action)!r}")
        wrong += [f"{flag}: choice {choice} not named" for choice in action.choices or ()
                  if f"`{choice}`" not in line]
    assert len(rows) > 100, "no flag rows found in docs/flags.md"
    assert not wrong, wrong
