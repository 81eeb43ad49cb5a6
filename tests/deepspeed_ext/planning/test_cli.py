"""``moc-plan`` in process: recommend, simulate, bad inputs, flags, model and hardware files."""

import json
import os

import pytest

from deepspeed_ext.planning import calibrate
from deepspeed_ext.planning.cli import main, model_from_config, parse_policy, training_flags
from deepspeed_ext.planning.costs import Hardware, Policy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
CONFIG = os.path.join(REPO, "configs", "gpt-350m-16e.yaml")
CLUSTER = ["--config", CONFIG, "--gpus", "16", "--mtbf", "3600"]


def _error(capsys, argv, *needles):
    """Run ``argv``; expect exit code 2 and every needle in the message."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moc-plan: error: ")
    for needle in needles:
        assert needle in err, err
    return err


# --- model and hardware files -----------------------------------------------------------------

def test_model_from_config():
    m = model_from_config(CONFIG)
    assert m.name == "gpt-350m-16e"
    assert m.num_experts == 16
    assert m.num_moe_layers == 12
    assert m.params_total == pytest.approx(1.87e9, rel=0.01)
    assert m.params_expert == pytest.approx(1.61e9, rel=0.01)
    assert m.params_non_expert == m.params_total - m.params_expert
    assert m.tokens_per_iteration > 0


def test_model_from_missing_config(tmp_path):
    with pytest.raises(ValueError, match="--config: file not found"):
        model_from_config(str(tmp_path / "nope.yaml"))


def test_hardware_from_json(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"hardware": {"iteration_s": 2.5, "restart_s": 30.0},
                                "sources": {}}))
    hw = calibrate.hardware_from_json(str(path))
    assert hw == Hardware(iteration_s=2.5, restart_s=30.0)
    # the flat form (written by hand)
    path.write_text(json.dumps({"iteration_s": 1.5, "d2h_gbps": 5}))
    assert calibrate.hardware_from_json(str(path)).d2h_gbps == 5


def test_hardware_from_json_rejects_unknown_fields(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"iteration_s": 1.0, "bogus": 1, "zzz_speed": 2}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bogus', 'zzz_speed'\]") as err:
        calibrate.hardware_from_json(str(path))
    assert str(path) in str(err.value)
    path.write_text(json.dumps({"iteration_s": -1.0}))
    with pytest.raises(ValueError, match=r"iteration_s \(--iteration-time\) must be > 0"):
        calibrate.hardware_from_json(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="--hardware"):
        calibrate.hardware_from_json(str(path))


def test_hardware_from_json_list_is_a_clear_error(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="--hardware"):
        calibrate.hardware_from_json(str(path))


def test_from_benchmark_json(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({
        "config": {"ranks_per_node": 4},
        "rows": [{"system": "no-checkpoint", "iter_s_mean": 0.75},
                 {"system": "replicate", "bandwidth_mib_s": 1000.0},
                 {"system": "two-level", "iter_s_mean": 0.9}]}))
    found = calibrate.from_benchmark_json([str(path)])
    assert set(found) == {"iteration_s", "network_gbps"}
    assert found["iteration_s"][0] == 0.75
    assert "no-checkpoint" in found["iteration_s"][1]
    # 1000 MiB/s per rank x 4 ranks per node = 1000 * 2**20 * 4 / 1e9 GB/s
    assert found["network_gbps"][0] == pytest.approx(4.194304)
    assert "replicate protection bandwidth" in found["network_gbps"][1]


def test_from_benchmark_json_phase_lists_and_restart(tmp_path):
    path = tmp_path / "exact.json"
    path.write_text(json.dumps({"train": [{"mode": "none", "iter_s_mean": 0.5}],
                                "restart": [{"mode": "exact", "restart_s": 42.0}]}))
    found = calibrate.from_benchmark_json([str(path)])
    assert found["iteration_s"][0] == 0.5
    assert found["restart_s"][0] == 42.0


def test_from_benchmark_json_top_level_list(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([{"system": "replicate", "bandwidth_mib_s": 1000.0}]))
    found = calibrate.from_benchmark_json([str(path)])
    assert found["network_gbps"][0] == pytest.approx(1000 * 2**20 / 1e9)


def test_measure_storage_gbps(tmp_path):
    out = calibrate.measure_storage_gbps(str(tmp_path / "sub"), mbytes=8)
    assert set(out) == {"write_gbps", "read_gbps"}
    assert out["write_gbps"] > 0 and out["read_gbps"] > 0
    assert os.listdir(tmp_path / "sub") == []              # its file is removed


# --- trainer flags ------------------------------------------------------------------------

@pytest.mark.parametrize("policy,flags", [
    (Policy("full-sync", interval=50),
     "--moc-checkpoint --save-interval 50 --moc-sync-save"),
    (Policy("full-async", interval=5), "--moc-checkpoint --save-interval 5"),
    (Policy("pec", interval=10, k=2), "--moc-checkpoint --save-interval 10 --moc-pec-k 2"),
    (Policy("pec-dynamic", interval=10, k=1),
     "--moc-checkpoint --save-interval 10 --moc-pec-k 1 --moc-dynamic-k --moc-plt-threshold 0.0375"),
    (Policy("exact", window=8), "--moc-checkpoint --moc-mode exact --moc-window 8"),
    (Policy("two-level", interval=2, persist_interval=10),
     "--moc-checkpoint --moc-two-level --moc-snapshot-interval 2 --moc-persist-interval 10"),
    (Policy("two-level", interval=1, persist_interval=100, k_snapshot=4, k=1,
            redundancy="erasure", ec_data=3),
     "--moc-checkpoint --moc-two-level --moc-snapshot-interval 1 --moc-persist-interval 100 "
     "--moc-k-snapshot 4 --moc-k-persist 1 --moc-redundancy erasure --moc-ec-data 3"),
    (Policy("two-level", redundancy="replicate"),
     "--moc-checkpoint --moc-two-level --moc-snapshot-interval 1 --moc-persist-interval 1 "
     "--moc-redundancy replicate"),
])
def test_training_flags(policy, flags):
    assert " ".join(training_flags(policy)) == flags


def test_training_flags_parse_with_the_trainer():
    from megatron.training.arguments import parse_args
    flags = training_flags(Policy("two-level", interval=2, persist_interval=10, k_snapshot=4,
                                  k=2, redundancy="replicate"))
    args = parse_args(["--config", CONFIG, "--data-path", "unused"] + flags)
    assert args.moc_two_level and args.moc_snapshot_interval == 2
    assert args.moc_persist_interval == 10 and args.moc_k_snapshot == 4
    assert args.moc_k_persist == 2 and args.moc_redundancy == "replicate"


def test_pec_dynamic_threshold_in_the_flags():
    flags = training_flags(Policy("pec-dynamic", interval=10, k=1, plt_threshold=0.1))
    assert "--moc-plt-threshold" in flags


def test_parse_policy():
    assert parse_policy("two-level:interval=1,persist_interval=10") == \
        Policy("two-level", interval=1, persist_interval=10)
    assert parse_policy("pec-dynamic:k=2,plt-threshold=0.5") == \
        Policy("pec-dynamic", k=2, plt_threshold=0.5)
    assert parse_policy("two-level:redundancy=erasure,ec_data=2") == \
        Policy("two-level", redundancy="erasure", ec_data=2)
    with pytest.raises(ValueError, match="--policy pec:k=x: k must be a number"):
        parse_policy("pec:k=x")
    with pytest.raises(ValueError, match="--policy exact: .*needs a window"):
        parse_policy("exact")
    with pytest.raises(ValueError, match="unknown setting 'kind'"):
        parse_policy("pec:kind=exact")


# --- recommend ------------------------------------------------------------------------------

def test_recommend_prints_table_and_flags(capsys, tmp_path):
    out_json = tmp_path / "rec.json"
    assert main(["recommend"] + CLUSTER + ["--iteration-time", "1.2",
                                           "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "gpt-350m-16e: 1.87B parameters (1.61B in 16 experts x 12 MoE layers) on 16 GPUs" \
        in out
    assert "MTBF 3600 s" in out
    assert "policy " in out and "ETTR" in out
    assert " GiB  " in out                          # host memory in the unit of its flag
    lines = out.splitlines()
    rec = [ln for ln in lines if ln.startswith("recommended: ")]
    assert len(rec) == 1
    flags = [ln for ln in lines if ln.strip().startswith("trainer flags: --moc-checkpoint")]
    assert len(flags) == 1
    data = json.loads(out_json.read_text())
    assert data["mtbf_s"] == 3600
    assert data["hardware"]["iteration_s"] == 1.2
    assert data["layout"]["gpus"] == 16
    assert data["model"]["num_experts"] == 16
    rows = data["rows"]
    assert sorted(r["policy"] for r in rows) == sorted(
        ["full-sync", "full-async", "pec", "pec-dynamic", "two-level", "exact"])
    scored = [r["ettr"] for r in rows if r.get("ettr") is not None]
    assert scored == sorted(scored, reverse=True)
    best = rows[0]
    assert 0 < best["ettr"] <= 1
    assert f"recommended: {best['label']} (predicted ETTR {best['ettr']:.3f})" == rec[0]
    assert flags[0].strip() == "trainer flags: " + " ".join(
        training_flags(Policy(**best["settings"])))
    # one table line per family
    for r in rows:
        assert any(ln.startswith(r["policy"] + " ") for ln in lines)


def test_recommend_with_hardware_file(capsys, tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"hardware": {"iteration_s": 2.0, "restart_s": 5.0}}))
    assert main(["recommend"] + CLUSTER + ["--hardware", str(path), "--restart-s", "7",
                                           "--policies", "full-sync,pec"]) == 0
    out = capsys.readouterr().out
    assert "iteration 2 s, restart 7 s" in out                 # the flag beats the file
    assert "exact" not in out and "two-level" not in out


# --- simulate -------------------------------------------------------------------------------

def test_simulate_explicit_policy(capsys, tmp_path):
    out_json = tmp_path / "sim.json"
    assert main(["simulate"] + CLUSTER + ["--iteration-time", "1.2", "--seeds", "2",
                                          "--iterations", "2000", "--json", str(out_json),
                                          "--policy",
                                          "two-level:interval=1,persist_interval=10"]) == 0
    out = capsys.readouterr().out
    assert "2000 iterations per run, 2 seed(s)" in out
    assert "two-level every 1 Ks=all persist/10" in out
    data = json.loads(out_json.read_text())
    assert data["iterations"] == 2000 and data["seeds"] == [0, 1]
    (row,) = data["rows"]
    assert row["policy"] == "two-level" and row["runs"] == 2 and row["mtbf_s"] == 3600
    assert row["settings"]["persist_interval"] == 10
    assert 0 < row["ettr"] <= 1 and 0 < row["ettr_model"] <= 1
    assert row["plt"] == 0.0


def test_simulate_trace_and_several_mtbfs(capsys, tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("# failures\n100 software\n500 node\n")
    out_json = tmp_path / "sim.json"
    argv = ["simulate", "--config", CONFIG, "--gpus", "16", "--mtbf", "600,3600",
            "--iteration-time", "1", "--iterations", "1000", "--trace", str(trace),
            "--policy", "full-async:interval=10", "--policy", "pec:interval=10,k=4",
            "--json", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"trace {trace}" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["mtbf_s"], r["policy"]) for r in rows] == [
        (600, "full-async"), (600, "pec"), (3600, "full-async"), (3600, "pec")]
    assert all(r["runs"] == 1 and r["failures"] == 2 for r in rows)


def test_simulate_default_policies_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")  # the [bench] extra; CI's venv has only [test]
    png = tmp_path / "out.png"
    argv = ["simulate"] + CLUSTER + ["--iteration-time", "1.2", "--seeds", "1",
                                     "--iterations", "500", "--policies", "full-async,pec",
                                     "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"plot: {png}" in out
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- bad inputs -----------------------------------------------------------------------------

def test_bad_mtbf(capsys):
    _error(capsys, ["recommend", "--config", CONFIG, "--gpus", "16", "--mtbf", "0",
                    "--iteration-time", "1.2"], "--mtbf must be > 0")
    _error(capsys, ["recommend", "--config", CONFIG, "--gpus", "16", "--mtbf", "abc",
                    "--iteration-time", "1.2"], "--mtbf: expected seconds")
    _error(capsys, ["recommend", "--config", CONFIG, "--gpus", "16", "--mtbf", "60,600",
                    "--iteration-time", "1.2"], "recommend takes one --mtbf")


def test_bad_layout(capsys):
    _error(capsys, ["recommend", "--config", CONFIG, "--gpus", "12", "--gpus-per-node", "8",
                    "--mtbf", "3600", "--iteration-time", "1.2"],
           "--gpus 12", "--gpus-per-node 8")
    _error(capsys, ["recommend"] + CLUSTER + ["--ep", "3", "--iteration-time", "1.2"],
           "--ep 3 must divide --gpus 16")


def test_missing_config(capsys, tmp_path):
    missing = str(tmp_path / "missing.yaml")
    _error(capsys, ["recommend", "--config", missing, "--gpus", "16", "--mtbf", "3600",
                    "--iteration-time", "1.2"], "--config", "file not found", missing)


def test_unknown_policy_key(capsys):
    _error(capsys, ["simulate"] + CLUSTER + ["--iteration-time", "1.2",
                                             "--policy", "two-level:bogus=1"],
           "--policy two-level:bogus=1", "unknown setting 'bogus'")


def test_no_iteration_time(capsys):
    _error(capsys, ["recommend"] + CLUSTER, "--iteration-time", "--hardware")


@pytest.mark.parametrize("line, why", [("not-a-number node", ""),
                                       ("nan node", ": a failure time must be a finite")])
def test_malformed_trace(capsys, tmp_path, line, why):
    trace = tmp_path / "bad.txt"
    trace.write_text(f"100 software\n{line}\n")
    _error(capsys, ["simulate"] + CLUSTER + ["--iteration-time", "1.2", "--trace", str(trace),
                                             "--policy", "full-async"],
           f"--trace {trace} line 2: '{line}'{why}")
    _error(capsys, ["simulate"] + CLUSTER + ["--iteration-time", "1.2",
                                             "--trace", str(tmp_path / "none.txt"),
                                             "--policy", "full-async"], "--trace")


def test_other_bad_inputs(capsys, tmp_path):
    _error(capsys, ["simulate"] + CLUSTER + ["--iteration-time", "1.2", "--seeds", "0"],
           "--seeds must be >= 1")
    _error(capsys, ["simulate"] + CLUSTER + ["--iteration-time", "1.2", "--iterations", "0"],
           "--iterations must be >= 1")
    _error(capsys, ["recommend"] + CLUSTER + ["--iteration-time", "1.2",
                                              "--node-failure-fraction", "2"],
           "--node-failure-fraction must be in [0, 1]")
    _error(capsys, ["recommend"] + CLUSTER + ["--iteration-time", "1.2", "--plt-limit", "-1"],
           "--plt-limit must be in [0, 1]")
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"iteration_s": 1.0, "bogus": 1}))
    _error(capsys, ["recommend"] + CLUSTER + ["--hardware", str(hw)],
           f"--hardware {hw}", "'bogus'")


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as err:
        main(["recommend", "--config", CONFIG, "--mtbf", "3600"])   # no --gpus
    assert err.value.code == 2
    assert "--gpus" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(capsys, tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    _error(capsys, ["simulate"] + CLUSTER + ["--iteration-time", "1.2", "--seeds", "1",
                                             "--iterations", "100", "--plot",
                                             str(tmp_path / "x.png")],
           "--plot needs matplotlib")


def test_exact_bench_figures_background_uses_every_round():
    # none: rounds 0.10 and 0.12 s (mean 0.11); two-level: 0.13 and 0.17 s (mean 0.15);
    # the fastest of each would give 0.13 - 0.10 instead of 0.15 - 0.11.
    # PEC: a 20 ms save every 10 iterations = 2 ms per iteration, not background work.
    # Moved per rank per iteration: (30e6 + 2e6) B / 2 ranks = 16e6 B = 0.016 GB.
    data = {"options": {"nproc": 2, "save_interval": 10},
            "overhead": [
                {"policy": "none", "ok": True, "iter_s_mean": 0.10,
                 "rounds": [{"ok": True, "iter_s_mean": 0.10}, {"ok": True, "iter_s_mean": 0.12}]},
                {"policy": "two-level-full", "ok": True, "iter_s_mean": 0.13,
                 "mem_bytes_per_iter": 30e6, "storage_bytes_per_iter": 2e6,
                 "rounds": [{"ok": True, "iter_s_mean": 0.13}, {"ok": True, "iter_s_mean": 0.17},
                            {"ok": False, "iter_s_mean": 9.0}]},
                {"policy": "pec-dynamic", "ok": True, "stall_ms_median": 20.0}]}
    found = calibrate.exact_bench_figures(data)
    assert found["background_s_per_gb"][0] == pytest.approx((0.15 - 0.11 - 0.002) / 0.016)
    assert "mean over rounds" in found["background_s_per_gb"][1]


def test_exact_bench_figures_without_rounds_uses_the_row():
    data = {"options": {"nproc": 1, "save_interval": 10},
            "overhead": [{"policy": "none", "ok": True, "iter_s_mean": 0.10},
                         {"policy": "two-level-full", "ok": True, "iter_s_mean": 0.12,
                          "mem_bytes_per_iter": 1e9, "storage_bytes_per_iter": 0.0}]}
    found = calibrate.exact_bench_figures(data)
    assert found["background_s_per_gb"][0] == pytest.approx(0.02)
    assert "warmup_s" not in found  # no run directories to read


# --- units in --help ------------------------------------------------------------------------

def _subparser(name):
    from deepspeed_ext.planning.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


@pytest.mark.parametrize("command", ["recommend", "simulate"])
def test_hardware_flags_state_unit_and_scope(command):
    helps = {a.dest: a.help for a in _subparser(command)._actions}
    scopes = {"d2h_gbps": "per rank", "h2d_gbps": "per rank", "storage_write_gbps": "per node",
              "storage_read_gbps": "per node", "network_gbps": "per node",
              "storage_total_gbps": "aggregate"}
    for dest, scope in scopes.items():
        assert "GB/s = 1e9 bytes/s" in helps[dest], (dest, helps[dest])
        assert scope in helps[dest], (dest, helps[dest])
    for dest in ("restart_s", "node_replace_s", "warmup_s", "snapshot_call_s",
                 "persist_call_s", "save_call_s", "iteration_time"):
        assert "seconds" in helps[dest].lower(), (dest, helps[dest])
    assert "GiB (2**30 bytes" in helps["host_memory_gb"]
    # the flag names are unchanged
    assert main(["recommend"] + CLUSTER + ["--iteration-time", "1.2", "--d2h-gbps", "5",
                                           "--storage-total-gbps", "0", "--policies",
                                           "full-sync"]) == 0


# --- policies the trainer refuses -----------------------------------------------------------

@pytest.mark.parametrize("policy,needles", [
    ("two-level:k=8,k_snapshot=2",
     ["--policy two-level:k=8,k_snapshot=2: the trainer refuses it: --moc-k-persist"]),
    ("pec-dynamic:k=1,plt_threshold=0",
     ["--policy pec-dynamic:k=1,plt_threshold=0: the trainer refuses it: "
      "--moc-plt-threshold must be in (0, 1)"]),
    ("two-level:redundancy=erasure,ec_data=4",       # 16 GPUs: 2 nodes, groups of 5
     ["the trainer refuses it on this layout: --moc-redundancy erasure with --moc-ec-data 4"]),
])
def test_policies_the_trainer_refuses(capsys, policy, needles):
    _error(capsys, ["simulate"] + CLUSTER + ["--iteration-time", "1.2", "--iterations", "100",
                                             "--policy", policy], *needles)


# --- non-finite numbers -----------------------------------------------------------------------

@pytest.mark.parametrize("flag,value,needle", [
    ("--restart-s", "nan", "restart_s (--restart-s) must be a finite number"),
    ("--iteration-time", "inf", "iteration_s (--iteration-time) must be a finite number"),
    ("--host-memory-gb", "nan", "--host-memory-gb must be a finite number"),
    ("--plt-limit", "nan", "--plt-limit must be in [0, 1]"),
])
def test_non_finite_numbers_are_bad_input(capsys, flag, value, needle):
    argv = ["recommend"] + CLUSTER + ["--iteration-time", "1.2", flag, value]
    _error(capsys, argv, needle)


def test_infinite_mtbf(capsys):
    _error(capsys, ["recommend", "--config", CONFIG, "--gpus", "16", "--mtbf", "inf",
                    "--iteration-time", "1.2"], "--mtbf must be > 0 seconds and finite")


# --- output files -------------------------------------------------------------------------------

@pytest.mark.parametrize("command,flag", [("recommend", "--json"), ("simulate", "--json"),
                                          ("simulate", "--plot")])
def test_output_into_a_missing_directory_fails_before_any_work(capsys, tmp_path, command, flag):
    out = tmp_path / "missing" / "out.json"
    extra = ["--iterations", "100"] if command == "simulate" else []
    err = _error(capsys, [command] + CLUSTER + extra + ["--iteration-time", "1.2", "--policies",
                                                        "full-sync", flag, str(out)],
                 f"{flag} {out}: the directory {tmp_path / 'missing'} does not exist")
    assert "Traceback" not in err
    assert capsys.readouterr().out == ""                     # nothing ran


# --- the batch must split over the GPUs, as the trainer requires ------------------------------

def test_global_batch_must_divide_over_the_gpus(capsys):
    # 256 sequences per step, 4 per micro-batch: 128 ranks would need 512
    _error(capsys, ["recommend", "--config", CONFIG, "--gpus", "128", "--mtbf", "3600",
                    "--iteration-time", "1.2"],
           "--gpus 128", "--global-batch-size 256",
           "--micro-batch-size x data-parallel size (4 x 128 = 512)")


def test_unset_global_batch_is_a_micro_batch_per_rank(tmp_path):
    text = open(CONFIG).read()
    assert "global-batch-size: 256\n" in text
    path = tmp_path / "no-global.yaml"
    path.write_text(text.replace("global-batch-size: 256\n", ""))
    m = model_from_config(str(path), gpus=16)
    assert m.tokens_per_iteration == 4 * 16 * 2048
    assert model_from_config(CONFIG, gpus=16).tokens_per_iteration == 256 * 2048
