"""``moc-plan``'s in-job restart: simulate's --restart/--spares/--repair-s and phase
flags, their refusals (each naming its flag), recommend's weighing of spare nodes, the
``in_job`` object of a hardware file and calibrate's reading of restart_bench.py's JSON,
and docs/planning.md's commands with the figures it quotes."""

import json
import os

import pytest

from deepspeed_ext.planning import calibrate
from deepspeed_ext.planning.cli import main
from deepspeed_ext.planning.restart import InJobPhases

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
CONFIG = os.path.join(REPO, "configs", "gpt-350m-16e.yaml")
CLUSTER = ["--config", CONFIG, "--gpus", "16", "--mtbf", "3600", "--iteration-time", "1.2"]
TWO_LEVEL = "two-level:interval=1,persist_interval=10"
BIG = ["--config", "configs/moe-250b.yaml", "--gpus", "4096", "--mtbf", "600",
       "--iteration-time", "8", "--restart-s", "120", "--node-failure-fraction", "0.2"]
"""docs/planning.md's cluster: MoE-250B on 4,096 GPUs at a 10-minute MTBF."""


def _error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moc-plan: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


# --- simulate -------------------------------------------------------------------------------

def test_simulate_in_job_prints_the_phases_and_the_share_in_place(capsys, tmp_path):
    out_json = tmp_path / "sim.json"
    assert main(["simulate"] + CLUSTER + ["--seeds", "2", "--iterations", "2000",
                                          "--policy", TWO_LEVEL, "--restart", "in-job",
                                          "--spares", "8", "--repair-s", "600",
                                          "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    # 0.1 + 0.1 + 0 + 0 + (0.07 + 0.0005 x 16 = 0.078) + 2.5 = 2.778 s before the state
    line = next(ln for ln in out.splitlines() if ln.startswith("in-job restart: "))
    assert "groups 0.08, engine 2.50" in line and "groups at 16 ranks" in line
    assert "largest phase: engine 2.50 s" in line
    assert "a relaunch: restart 60 s + the load" in line
    assert "8 spare GPUs (1 node(s) of 8), each failure's back after 600 s" in line
    assert " in place  settings" in out
    data = json.loads(out_json.read_text())
    assert data["restart"]["mode"] == "in-job" and data["restart"]["spares"] == 8
    assert data["restart"]["phases"]["engine_s"] == 2.5
    (row,) = data["rows"]
    assert 0 < row["in_place"] <= 1
    assert f"{row['in_place']:>8.0%}  two-level" in out


def test_a_relaunch_prints_no_in_job_line(capsys):
    assert main(["simulate"] + CLUSTER + ["--seeds", "1", "--iterations", "500",
                                          "--policy", TWO_LEVEL]) == 0
    out = capsys.readouterr().out
    assert "in-job restart" not in out and "in place" not in out


def test_the_phase_flags_set_the_restart(capsys, tmp_path):
    # groups 0.07 + 0.1 x 16 = 1.67 s now beat an engine of 0.5 s
    assert main(["simulate"] + CLUSTER + ["--seeds", "1", "--iterations", "500",
                                          "--policy", TWO_LEVEL, "--restart", "in-job",
                                          "--in-job-groups-per-rank-s", "0.1",
                                          "--in-job-engine-s", "0.5",
                                          "--in-job-detection-s", "1"]) == 0
    out = capsys.readouterr().out
    assert "detection 1.00" in out and "groups 1.67, engine 0.50" in out
    assert "largest phase: groups 1.67 s" in out


def test_more_spares_more_ettr(capsys, tmp_path):
    ettr = {}
    for spares in ("0", "8", "16"):
        out_json = tmp_path / f"{spares}.json"
        assert main(["simulate"] + CLUSTER + ["--mtbf", "600", "--seeds", "2", "--iterations",
                                              "3000", "--policy", TWO_LEVEL,
                                              "--node-failure-fraction", "0.3",
                                              "--restart", "in-job", "--spares", spares,
                                              "--json", str(out_json)]) == 0
        (row,) = json.loads(out_json.read_text())["rows"]
        ettr[spares] = (row["ettr"], row["in_place"])
    assert ettr["0"][1] == 0.0 < ettr["8"][1] < ettr["16"][1]
    assert ettr["0"][0] < ettr["8"][0] < ettr["16"][0]


# --- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,needles", [
    (["--restart", "in-job", "--spares", "-1"], ["--spares must be an integer >= 0, got -1"]),
    (["--spares", "8"], ["--spares needs --restart in-job"]),
    (["--restart", "in-job", "--repair-s", "-5"],
     ["--repair-s must be a finite number of seconds >= 0, got -5.0"]),
    (["--restart", "in-job", "--repair-s", "nan"], ["--repair-s must be a finite number"]),
    (["--restart", "in-job", "--in-job-engine-s", "-1"],
     ["--in-job-engine-s must be a finite number of seconds >= 0, got -1.0"]),
    (["--restart", "in-job", "--in-job-groups-per-rank-s", "inf"],
     ["--in-job-groups-per-rank-s must be a finite number"]),
    (["--restart", "in-job", "--spares", "4", "--node-failure-fraction", "0.2"],
     ["--spares 4: spares are whole spare nodes, a multiple of 8 (--gpus-per-node): every "
      "failure moves a node's ranks"]),
])
def test_simulate_refuses_bad_restart_settings(capsys, extra, needles):
    _error(capsys, ["simulate"] + CLUSTER + ["--iterations", "100"] + extra, *needles)
    assert capsys.readouterr().out == ""


def test_spares_are_whole_nodes_even_without_node_failures(capsys):
    """A crash on a node with no spare process moves the node whole: spares below a node
    would never be used."""
    _error(capsys, ["simulate"] + CLUSTER + ["--seeds", "1", "--iterations", "500",
                                             "--policy", TWO_LEVEL, "--restart", "in-job",
                                             "--spares", "2", "--node-failure-fraction", "0"],
           "--spares 2: spares are whole spare nodes, a multiple of 8")


def test_an_unknown_restart_mode_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as err:
        main(["simulate"] + CLUSTER + ["--restart", "respawn"])
    assert err.value.code == 2
    assert "--restart" in capsys.readouterr().err


def test_recommend_refuses_negative_spare_nodes(capsys):
    _error(capsys, ["recommend"] + CLUSTER + ["--max-spare-nodes", "-1"],
           "--max-spare-nodes must be >= 0, got -1")


# --- recommend ------------------------------------------------------------------------------

def test_recommend_spares_do_not_pay_on_two_nodes(capsys, tmp_path):
    out_json = tmp_path / "rec.json"
    assert main(["recommend"] + CLUSTER + ["--mtbf", "600", "--max-spare-nodes", "2",
                                           "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "policies under the chosen restart: relaunch" in out
    assert "* relaunch " in out
    assert "  in-job, 8 spares (1 node) " in out and "  in-job, 16 spares (2 nodes) " in out
    assert "restart: relaunch: spares do not pay here" in out
    assert "holds back 50.0% more GPUs" in out
    flags = next(ln for ln in out.splitlines() if "trainer flags:" in ln)
    assert "--moc-restart" not in flags
    data = json.loads(out_json.read_text())
    assert data["recommended_restart"]["mode"] == "relaunch"
    rows = {r["spare_gpus"]: r for r in data["restart"]}
    assert set(rows) == {0, 8, 16} and rows[0]["chosen"]
    # effective = ETTR x 16 / (16 + spares)
    assert rows[8]["effective"] == pytest.approx(rows[8]["ettr"] * 16 / 24)
    assert rows[8]["ettr"] > rows[0]["ettr"] > rows[8]["effective"]


def test_recommend_without_spare_nodes_is_a_relaunch(capsys):
    assert main(["recommend"] + CLUSTER + ["--max-spare-nodes", "0"]) == 0
    out = capsys.readouterr().out
    assert "restart: relaunch (no in-job plan considered: --max-spare-nodes 0)" in out
    assert "in-job restart:" not in out


def test_the_in_job_flags_parse_with_the_trainer():
    from megatron.training.arguments import parse_args
    args = parse_args(["--config", CONFIG, "--data-path", "unused", "--moc-checkpoint",
                       "--moc-restart", "in-job", "--moc-spares", "40"])
    assert args.moc_restart == "in-job" and args.moc_spares == 40


# --- docs/planning.md's figures -------------------------------------------------------------

def test_the_docs_in_job_simulation_at_4096_gpus(capsys):
    """docs/planning.md's command, and the figures it quotes (relaunch: 0.817)."""
    assert main(["simulate"] + BIG + ["--seeds", "3", "--restart", "in-job",
                                      "--spares", "96"]) == 0
    out = capsys.readouterr().out
    assert ("in-job restart: 4.85 s with a spare (detection 0.10, leave 0.10, teardown "
            "0.00, rendezvous 0.00, groups 2.12, engine 2.50, state 0.04, first step 0.00;"
            in out)
    assert "largest phase: engine 2.50 s (52%)" in out
    assert "96 spare GPUs (12 node(s) of 8), each failure's back after 3600 s" in out
    assert "600 two-level        0.984 ±0.006        0.983" in out
    assert "600 exact            0.911 ±0.011        0.911" in out  # the trainer takes it now
    assert main(["simulate"] + BIG + ["--seeds", "3", "--policy",
                                      "two-level:k=1,k_snapshot=32,redundancy=erasure,ec_data=7"]) == 0
    assert "600 two-level        0.817 ±0.005" in capsys.readouterr().out


def test_the_docs_recommendation_at_4096_gpus(capsys):
    """docs/planning.md's ``recommend`` at 4,096 GPUs: twelve spare nodes pay."""
    assert main(["recommend"] + BIG) == 0
    out = capsys.readouterr().out
    assert "* in-job, 96 spares (12 nodes)           96  0.983     0.961      99%" in out
    assert "  relaunch                                0  0.829     0.829" in out
    assert ("restart: in-job, 96 spares (12 nodes): the spares pay: effective throughput "
            "0.961 = ETTR 0.983 x 4096 / 4192, against 0.829 relaunched (ETTR +18.7% for "
            "2.3% more GPUs)") in out
    assert "--moc-restart in-job --moc-spares 0\n  launch: SPARE_NODES=12 (" in out


# --- calibration hooks ------------------------------------------------------------------------

def test_the_hardware_files_in_job_phases_and_the_flags_over_them(capsys, tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"hardware": {"iteration_s": 1.2},
                              "in_job": {"engine_s": 0.25, "detection_s": 0.5}}))
    assert main(["simulate", "--config", CONFIG, "--gpus", "16", "--mtbf", "3600",
                 "--hardware", str(hw), "--seeds", "1", "--iterations", "500", "--policy",
                 TWO_LEVEL, "--restart", "in-job", "--in-job-detection-s", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "detection 0.30" in out and "engine 0.25" in out     # the flag beats the file
    hw.write_text(json.dumps({"hardware": {"iteration_s": 1.2}, "in_job": {"warp_s": 1}}))
    _error(capsys, ["simulate", "--config", CONFIG, "--gpus", "16", "--mtbf", "3600",
                    "--hardware", str(hw), "--restart", "in-job"], f"--hardware {hw}: in_job")
    hw.write_text(json.dumps({"hardware": {"iteration_s": 1.2}, "in_job": {"engine_s": -2}}))
    _error(capsys, ["simulate", "--config", CONFIG, "--gpus", "16", "--mtbf", "3600",
                    "--hardware", str(hw), "--restart", "in-job"],
           f"--hardware {hw}: in_job: --in-job-engine-s must be")


def _restart_bench(repeats):
    return {"options": {"ranks": 4}, "repeats": repeats, "summary": {}}


def _bench_row(job, phases, load_s, ok=True):
    return {"job": job, "ok": ok, "phases_s": phases, "recovery": {"load_s": load_s}}


IN_JOB_MARKS = {"death noticed": 0.05, "round written": 0.06, "survivors left": 0.02,
                "survivors torn down": 0.1, "every process in round 1": 0.3,
                "model being built": 1.0, "state restored": 3.0, "training resumed": 3.1,
                "first iteration done": 3.5}


def test_calibrate_reads_restart_bench_phases(tmp_path):
    # relaunch: state restored at 9.0 s and 11.0 s, loads 0.5 s: restart 10.0 - 0.5
    # in-job (two runs, the second with every mark 0.2 s later; medians = the first's +
    # 0.1): detection 0.16; leave 0.02 - 0.06 < 0: 0; teardown 0.2 - 0.12 = 0.08;
    # rendezvous 0.4 - 0.2 = 0.2; groups 1.1 - 0.4 = 0.7 less 0.0005 x 4 ranks = 0.698;
    # engine 3.1 - 1.1 - load 0.25 = 1.75; first step 3.6 - 3.1 = 0.5
    later = {k: v + 0.2 for k, v in IN_JOB_MARKS.items()}
    data = _restart_bench([
        {"relaunch": _bench_row("relaunch", {"state restored": 9.0}, 0.5),
         "in-job": _bench_row("in-job", IN_JOB_MARKS, 0.25)},
        {"relaunch": _bench_row("relaunch", {"state restored": 11.0}, 0.5),
         "in-job": _bench_row("in-job", later, 0.25)},
        {"in-job": _bench_row("in-job", {k: 99.0 for k in IN_JOB_MARKS}, 9.0, ok=False)}])
    found = calibrate.restart_bench_figures(data)
    assert found["restart_s"][0] == pytest.approx(9.5)
    values = {k.split(".", 1)[1]: v for k, (v, _) in found.items() if k.startswith("in_job.")}
    assert values == pytest.approx({"detection_s": 0.16, "leave_s": 0.0, "teardown_s": 0.08,
                                    "rendezvous_s": 0.2, "groups_s": 0.698, "engine_s": 1.75,
                                    "first_step_s": 0.5})
    InJobPhases(**values)                              # a valid set of phases
    assert "2 run(s), 4 ranks" in found["in_job.engine_s"][1]


def test_calibrate_writes_the_in_job_phases_for_hardware(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "measure_copy_gbps", lambda: 5.0)
    monkeypatch.setattr(calibrate, "measure_storage_gbps",
                        lambda directory: {"write_gbps": 1.0, "read_gbps": 2.0})
    bench = tmp_path / "restart_bench.json"
    bench.write_text(json.dumps(_restart_bench([
        {"relaunch": _bench_row("relaunch", {"state restored": 9.0}, 0.5),
         "in-job": _bench_row("in-job", IN_JOB_MARKS, 0.25)}])))
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--dir", str(tmp_path / "d"), "--out", str(out),
                 "--from-json", str(bench), "--iteration-time", "1.2"]) == 0
    printed = capsys.readouterr().out
    assert "in_job.engine_s" in printed and "restart_s" in printed
    assert calibrate.hardware_from_json(str(out)).restart_s == pytest.approx(8.5)
    assert calibrate.in_job_from_json(str(out))["engine_s"] == pytest.approx(1.75)
    # the file drives a simulation: its engine phase is the one printed
    assert main(["simulate", "--config", CONFIG, "--gpus", "16", "--mtbf", "3600",
                 "--hardware", str(out), "--seeds", "1", "--iterations", "500", "--policy",
                 TWO_LEVEL, "--restart", "in-job"]) == 0
    assert "engine 1.75" in capsys.readouterr().out


def test_a_malformed_restart_bench_names_the_file(tmp_path):
    bench = tmp_path / "rb.json"
    bench.write_text(json.dumps(_restart_bench([{"in-job": _bench_row(
        "in-job", {k: "soon" for k in IN_JOB_MARKS}, 0.1)}])))
    with pytest.raises(ValueError, match=f"--from-json {bench}: its repeats cannot be read"):
        calibrate.from_benchmark_json([str(bench)])


MEASURED = ["--in-job-detection-s", "0.105", "--in-job-leave-s", "0.046",
            "--in-job-teardown-s", "0.098", "--in-job-rendezvous-s", "0.001",
            "--in-job-groups-s", "0.054", "--in-job-engine-s", "0.403",
            "--in-job-first-step-s", "0.071"]
"""docs/planning.md's phases, from `moc-plan calibrate --from-json` over restart_bench.py's
4-rank run (docs/failures.md)."""


def test_the_docs_in_job_simulation_with_the_measured_phases(capsys):
    """docs/planning.md's command with the phases measured on CPU: forming the groups at
    4,096 ranks then dominates, and two-level reaches 0.987."""
    assert main(["simulate"] + BIG + ["--seeds", "3", "--restart", "in-job",
                                      "--spares", "96"] + MEASURED) == 0
    out = capsys.readouterr().out
    assert ("in-job restart: 2.86 s with a spare (detection 0.10, leave 0.05, teardown "
            "0.10, rendezvous 0.00, groups 2.10, engine 0.40, state 0.04, first step 0.07;"
            in out)
    assert "largest phase: groups 2.10 s (73%)" in out
    assert "600 two-level        0.987 ±0.006        0.986" in out
