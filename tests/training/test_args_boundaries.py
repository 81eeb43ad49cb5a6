"""Boundaries of the trainer's argument checks (:mod:`megatron.training.args`) found by
mutation testing (``bash scripts/mutation.sh megatron/training/args``)."""

import types

import pytest

from deepspeed_ext.two_level import default_shm_dir
from megatron.errors import ConfigError
from megatron.training.args.checks import MAX_TIMEOUT_S, check_float
from megatron.training.args.configs import padded_vocab_size
from megatron.training.args.model import check_moe_schedule, check_tensor_parallel
from megatron.training.args.moc import check_moc_numbers, effective_shm_dir, nodes_max_index
from megatron.training.args.restart import check_restart
from megatron.training.args.training import data_parallel_size
from megatron.training.arguments import parse_args, validate_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--data-path", "some/prefix"]


def test_a_float_flag_must_be_above_zero_unless_zero_is_allowed():
    for bad in (0.0, -0.5):
        with pytest.raises(ConfigError, match=r"--x must be a finite number of seconds > 0, "):
            check_float("--x", bad, "seconds")
    check_float("--x", 0.0, "seconds", zero_ok=True)
    check_float("--x", 0.5, "seconds")


def test_the_padded_vocabulary_is_a_whole_number_of_rows():
    size = padded_vocab_size(50257, 128, 2)
    assert size == 50432 and type(size) is int


def test_wandb_companions_with_wandb_project_are_not_refused_for_lacking_it(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "wandb" else real(name, *a))
    validate_args(parse_args(BASE + ["--wandb-project", "p", "--wandb-exp-name", "n",
                                     "--wandb-save-dir", "w"]), world_size=1)
    with pytest.raises(ConfigError, match="--wandb-exp-name needs --wandb-project"):
        validate_args(parse_args(BASE + ["--wandb-exp-name", "n"]), world_size=1)


@pytest.mark.parametrize("flag, least, meaning", [
    ("--moc-pec-k", 0, " (0: all experts)"), ("--moc-keep", 0, " (0: keep all)"),
    ("--moc-ranks-per-node", 0, " (0: the launcher's count)"),
    ("--moc-redundancy-interval", 1, ""), ("--moc-persist-interval", 1, "")])
def test_each_moc_count_is_refused_just_below_its_least_value(flag, least, meaning):
    check_moc_numbers(parse_args(BASE + [flag, str(least)]))
    with pytest.raises(ConfigError) as err:
        check_moc_numbers(parse_args(BASE + [flag, str(least - 1)]))
    assert str(err.value) == f"{flag} must be >= {least}{meaning}, got {least - 1}"


@pytest.mark.parametrize("threshold", ["0", "1", "1.5"])
def test_the_plt_threshold_lies_strictly_between_0_and_1(threshold):
    with pytest.raises(ConfigError, match="--moc-plt-threshold must be in"):
        validate_args(parse_args(BASE + ["--moc-plt-threshold", threshold]), world_size=1)


MOC = ["--moc-checkpoint", "--save", "ck", "--num-experts", "4"]
EXACT = MOC + ["--moc-mode", "exact"]
TWO_LEVEL = MOC + ["--moc-two-level", "--moe-expert-parallel-size", "1"]


def test_upstream_logging_is_accepted_for_exact_mode_with_pipeline_stages():
    # The mode as a command line gives it: a string built at run time, not the literal.
    exact = MOC + ["--moc-mode", "".join(("ex", "act"))]
    validate_args(parse_args(BASE + exact + ["--moc-upstream-logging",
                                             "--pipeline-model-parallel-size", "2",
                                             "--zero-stage", "1"]),
                  world_size=2)


def test_a_slow_fault_may_sleep_as_long_as_python_can_time_and_no_longer():
    most = repr(MAX_TIMEOUT_S)
    validate_args(parse_args(BASE + ["--save", "ck", "--moc-fault", f"slow@2:slow={most}"]),
                  world_size=1)
    with pytest.raises(ConfigError, match="slow must be a finite number of seconds > 0, at most"):
        validate_args(parse_args(BASE + ["--save", "ck", "--moc-fault", "slow@2:slow=1e10"]),
                      world_size=1)


def test_lose_memory_faults_are_accepted_with_exact_modes_frames():
    validate_args(parse_args(BASE + EXACT + ["--moc-fault", "lose-memory@2:rank=0"]),
                  world_size=1)


def test_the_shm_dir_is_the_flag_else_derived_from_save_for_memory_modes_only():
    derived = default_shm_dir("ck")
    assert effective_shm_dir(parse_args(BASE + MOC)) is None
    assert effective_shm_dir(parse_args(BASE + EXACT)) == derived
    assert effective_shm_dir(parse_args(BASE + TWO_LEVEL)) == derived
    assert effective_shm_dir(parse_args(BASE + TWO_LEVEL + ["--moc-shm-dir", "/dev/shm/x"])) \
        == "/dev/shm/x"
    assert effective_shm_dir(parse_args(BASE + MOC + ["--moc-shm-dir", "/dev/shm/x"])) is None


def test_the_last_nodes_index_counts_whole_nodes():
    args = parse_args(BASE + TWO_LEVEL + ["--moc-ranks-per-node", "4"])
    assert [nodes_max_index(args, world) for world in (1, 4, 5, 10, 12)] == [0, 0, 1, 2, 2]


def test_k_snapshot_may_be_every_expert_but_no_more():
    validate_args(parse_args(BASE + TWO_LEVEL + ["--moc-k-snapshot", "4"]), world_size=1)
    with pytest.raises(ConfigError, match=r"--moc-k-snapshot \(5\) exceeds --num-experts \(4\)"):
        validate_args(parse_args(BASE + TWO_LEVEL + ["--moc-k-snapshot", "5"]), world_size=1)


def test_k_persist_may_be_every_expert_and_at_most_k_snapshot():
    validate_args(parse_args(BASE + TWO_LEVEL + ["--moc-k-persist", "4"]), world_size=1)
    validate_args(parse_args(BASE + TWO_LEVEL + ["--moc-k-persist", "2", "--moc-k-snapshot", "3"]),
                  world_size=1)
    validate_args(parse_args(BASE + TWO_LEVEL + ["--moc-k-persist", "3", "--moc-k-snapshot", "3"]),
                  world_size=1)
    with pytest.raises(ConfigError, match=r"--moc-k-persist \(4\) must not exceed --moc-k-snapshot"):
        validate_args(parse_args(BASE + TWO_LEVEL + ["--moc-k-persist", "4",
                                                     "--moc-k-snapshot", "3"]), world_size=1)


def test_the_tensor_parallel_check_takes_the_mlp_width_as_four_hidden_sizes_by_default():
    three = BASE[:2] + ["--hidden-size", "48", "--num-attention-heads", "3"] + BASE[6:]
    check_tensor_parallel(parse_args(three + ["--tensor-model-parallel-size", "3"]))
    # On its own (the heads check comes elsewhere): 4 x 50 splits over 4 ranks, 3 x 50 or
    # 5 x 50 would not.
    odd = BASE[:2] + ["--hidden-size", "50", "--num-attention-heads", "4"] + BASE[6:]
    check_tensor_parallel(parse_args(odd + ["--tensor-model-parallel-size", "4"]))
    with pytest.raises(ConfigError, match=r"--ffn-hidden-size \(100\) must be divisible by "
                                          r"--tensor-model-parallel-size \(3\)"):
        check_tensor_parallel(parse_args(three + ["--tensor-model-parallel-size", "3",
                                                  "--ffn-hidden-size", "100"]))


def test_a_dense_model_ignores_the_expert_interval_and_topk():
    validate_args(parse_args(BASE + ["--expert-interval", "5", "--topk", "2"]), world_size=1)
    with pytest.raises(ConfigError, match=r"--expert-interval \(5\) exceeds --num-layers \(2\)"):
        validate_args(parse_args(BASE + ["--num-experts", "4", "--expert-interval", "5"]),
                      world_size=1)


@pytest.mark.parametrize("tp, etp, experts, refused", [
    (1, True, 4, True), (2, False, 4, True), (2, True, 1, True), (2, True, 4, False)])
def test_a_parm_schedule_needs_experts_split_over_tensor_parallel_ranks(tp, etp, experts,
                                                                         refused):
    for schedule in ("parm-s1", "parm-s2"):
        args = types.SimpleNamespace(moe_schedule=schedule, tensor_model_parallel_size=tp,
                                     enable_expert_tensor_parallelism=etp, num_experts=experts,
                                     moe_schedule_costs=None)
        if refused:
            with pytest.raises(ConfigError, match=f"--moe-schedule {schedule} needs MoE layers"):
                check_moe_schedule(args)
        else:
            check_moe_schedule(args)


def test_restart_defaults_to_a_relaunch_without_spares():
    args = parse_args(BASE)
    assert (args.moc_restart, args.moc_spares) == ("relaunch", 0)
    check_restart(args, 1)
    with pytest.raises(ConfigError, match=r"--moc-spares must be >= 0, got -1"):
        check_restart(parse_args(BASE + ["--moc-spares", "-1"]), 1)
    with pytest.raises(ConfigError, match="--moc-spares needs --moc-restart in-job"):
        check_restart(parse_args(BASE + ["--moc-spares", "1"]), 1)
    with pytest.raises(ConfigError, match="--moc-refill-spares needs --moc-restart in-job"):
        check_restart(parse_args(BASE + ["--moc-refill-spares"]), 1)


def test_an_in_job_restart_needs_the_supervisor_and_checkpoints_saved_where_it_loads(
        monkeypatch):
    from deepspeed_ext.runtime.rounds import STORE_ENV
    in_job = ["--moc-restart", "in-job", "--moc-spares", "1"]
    saved = ["--moc-checkpoint", "--save", "ck/b", "--load", "ck/b"]
    monkeypatch.delenv(STORE_ENV, raising=False)
    with pytest.raises(ConfigError, match="needs MoC's supervisor"):
        check_restart(parse_args(BASE + in_job + saved), 2)
    monkeypatch.setenv(STORE_ENV, "127.0.0.1:1234")
    check_restart(parse_args(BASE + in_job + saved), 2)
    for other in (["--save", "ck/b", "--load", "ck/b"],                      # no MoC
                  ["--moc-checkpoint", "--save", "ck/b", "--load", "ck/a"],  # elsewhere
                  ["--moc-checkpoint", "--save", "ck/b"]):                   # no --load
        with pytest.raises(ConfigError, match="needs --moc-checkpoint and --load equal to"):
            check_restart(parse_args(BASE + in_job + other), 2)
    check_restart(parse_args(BASE + in_job + saved + ["--moc-mode", "exact"]), 2)  # replays


def test_schedule_costs_are_read_by_the_auto_schedule_only():
    def args(schedule):
        return types.SimpleNamespace(moe_schedule=schedule, tensor_model_parallel_size=1,
                                     enable_expert_tensor_parallelism=False, num_experts=4,
                                     moe_schedule_costs="costs.json")
    check_moe_schedule(args("".join(("au", "to"))))   # as a command line gives it
    with pytest.raises(ConfigError, match="--moe-schedule-costs is read by --moe-schedule auto"):
        check_moe_schedule(args("deepspeed"))


@pytest.mark.parametrize("value", ["-0.5", "1.0", "1.5"])
def test_dropout_lies_in_0_to_1(value):
    for flag in ("--hidden-dropout", "--attention-dropout"):
        with pytest.raises(ConfigError, match=f"{flag} must be in \\[0, 1\\), got"):
            validate_args(parse_args(BASE + [flag, value]), world_size=1)
    validate_args(parse_args(BASE + ["--hidden-dropout", "0", "--attention-dropout", "0.99"]),
                  world_size=1)


def test_the_data_parallel_size_of_pipeline_stages():
    bare = types.SimpleNamespace(moe_expert_parallel_size=1)   # a parser without those flags
    assert data_parallel_size(bare, 4) == 4
    staged = types.SimpleNamespace(moe_expert_parallel_size=1, tensor_model_parallel_size=1,
                                   pipeline_model_parallel_size=2)
    assert data_parallel_size(staged, 4) == 2
    with pytest.raises(ConfigError, match=r"world size \(3\) must be divisible by "
                                          r"--pipeline-model-parallel-size \(2\)"):
        data_parallel_size(staged, 3)


@pytest.mark.parametrize("flag", ["--save-interval", "--exit-interval", "--eval-iters",
                                  "--num-workers", "--num-threads"])
def test_counts_of_the_training_run_are_not_negative(flag):
    with pytest.raises(ConfigError, match=f"{flag} must be >= 0, got -1"):
        validate_args(parse_args(BASE + [flag, "-1"]), world_size=1)


def test_a_config_that_is_not_yaml_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("num-layers: [2\n")
    with pytest.raises(ConfigError, match=f"--config: {path} is not valid YAML"):
        parse_args(["--config", str(path)])
