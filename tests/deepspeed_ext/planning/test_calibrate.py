"""``moc-plan calibrate``'s reading of benchmark JSON: figures, malformed files, and the
order of checks (inputs before any measurement). The measurements are stubbed: they take
seconds of this shared machine and are tested in test_cli.py."""

import json

import pytest

from deepspeed_ext.planning import calibrate
from deepspeed_ext.planning.cli import main
from deepspeed_ext.planning.costs import Hardware


@pytest.fixture
def no_measuring(monkeypatch):
    """Stub the copy and storage measurements (5 GB/s copy, 1/2 GB/s write/read)."""
    monkeypatch.setattr(calibrate, "measure_copy_gbps", lambda: 5.0)
    monkeypatch.setattr(calibrate, "measure_storage_gbps",
                        lambda directory: {"write_gbps": 1.0, "read_gbps": 2.0})


@pytest.fixture
def must_not_measure(monkeypatch):
    """Fail the test if anything is measured."""
    def boom(*args, **kwargs):
        raise AssertionError("measured before the inputs were checked")
    for name in ("measure_copy_gbps", "measure_storage_gbps", "measure_training"):
        monkeypatch.setattr(calibrate, name, boom)


def _bench(tmp_path, data, name="bench.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_calibrate_from_json(tmp_path, no_measuring):
    bench = _bench(tmp_path, {"config": {"ranks_per_node": 2},
                              "rows": [{"system": "no-checkpoint", "iter_s_mean": 0.75},
                                       {"system": "replicate", "bandwidth_mib_s": 500.0},
                                       {"system": "two-level", "restart_s": 30.0},
                                       {"system": "pec", "restart_s": 50.0}]})
    result = calibrate.calibrate(str(tmp_path / "dir"), None, None, 2, 12, False, [bench])
    hw = Hardware(**result["hardware"])
    assert hw.iteration_s == 0.75
    assert hw.network_gbps == pytest.approx(500 * 2**20 * 2 / 1e9)
    assert hw.restart_s == 40.0                               # the median of 30 and 50
    assert hw.d2h_gbps == 5.0 and hw.storage_write_gbps == 1.0 and hw.storage_read_gbps == 2.0
    assert result["sources"]["iteration_s"] == f"{bench}: no-checkpoint iterations"
    assert result["sources"]["fwd_bwd_fraction"] == "default"


def test_calibrate_cli_from_json_writes_a_hardware_file(tmp_path, no_measuring, capsys):
    bench = _bench(tmp_path, {"rows": [{"system": "none", "iter_s_mean": 0.5}]})
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--dir", str(tmp_path / "d"), "--out", str(out),
                 "--from-json", bench]) == 0
    assert f"written: {out}" in capsys.readouterr().out
    assert calibrate.hardware_from_json(str(out)).iteration_s == 0.5


@pytest.mark.parametrize("data,needle", [
    ("42", "expected a benchmark's JSON object or list of rows, got int"),
    ('"text"', "got str"),
    ("{not json", "Expecting property name"),
    ({"rows": [{"system": "replicate", "bandwidth_mib_s": "fast"}]},
     "row 'replicate': bandwidth_mib_s must be a positive number, got 'fast'"),
    ({"rows": [{"system": "no-checkpoint", "iter_s_mean": -0.5}]},
     "row 'no-checkpoint': iter_s_mean must be a positive number, got -0.5"),
    ({"rows": [{"system": "none", "iter_s_mean": float("nan")}]},
     "row 'none': iter_s_mean must be a positive number, got nan"),
    ({"train": [{"mode": "exact", "restart_s": [1]}]}, "row 'exact': restart_s"),
    ({"config": {"ranks_per_node": "4"}, "rows": [{"system": "erasure", "bandwidth_mib_s": 1.0}]},
     "config.ranks_per_node must be an integer >= 1, got '4'"),
    ({"options": {"nproc": "x"}, "overhead": [
        {"policy": "none", "ok": True, "iter_s_mean": 0.1},
        {"policy": "two-level-full", "ok": True, "iter_s_mean": 0.2, "mem_bytes_per_iter": 1.0}]},
     "its overhead rows cannot be read"),
])
def test_malformed_benchmarks_name_the_file(tmp_path, data, needle):
    bench = _bench(tmp_path, data)
    with pytest.raises(ValueError) as err:
        calibrate.from_benchmark_json([bench])
    assert str(err.value).startswith(f"--from-json {bench}: ")
    assert needle in str(err.value)


def test_null_and_zero_figures_are_not_measured(tmp_path):
    bench = _bench(tmp_path, {"rows": [{"system": "none", "iter_s_mean": 0.4},
                                       {"system": "exact", "stall_ms_median": 0.0,
                                        "restart_s": None}]})
    assert set(calibrate.from_benchmark_json([bench])) == {"iteration_s"}


def test_inputs_are_checked_before_anything_is_measured(tmp_path, must_not_measure, capsys):
    bench = _bench(tmp_path, {"rows": [{"system": "none", "iter_s_mean": -1}]})
    with pytest.raises(ValueError, match=f"--from-json {bench}: row 'none': iter_s_mean"):
        calibrate.calibrate(str(tmp_path), None, None, 2, 12, False, [bench])
    with pytest.raises(ValueError, match="--config needs --data-path"):
        calibrate.calibrate(str(tmp_path), "configs/tiny.yaml", None, 2, 12, False, [])
    with pytest.raises(ValueError, match="no iteration time"):
        calibrate.calibrate(str(tmp_path), None, None, 2, 12, False, [])
    # the CLI: exit 2, one line, and the output directory checked first too
    assert main(["calibrate", "--dir", str(tmp_path), "--out", str(tmp_path / "hw.json"),
                 "--from-json", bench]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moc-plan: error: --from-json {bench}: ") and err.count("\n") == 1
    missing = tmp_path / "no" / "hw.json"
    assert main(["calibrate", "--dir", str(tmp_path), "--out", str(missing),
                 "--iteration-time", "1"]) == 2
    assert f"--out {missing}: the directory" in capsys.readouterr().err


def test_a_failed_calibration_run_is_a_clean_error(tmp_path, no_measuring, monkeypatch, capsys):
    def failed(*args, **kwargs):
        raise RuntimeError("the calibration run failed (1):\nsome log tail")
    monkeypatch.setattr(calibrate, "measure_training", failed)
    assert main(["calibrate", "--dir", str(tmp_path), "--out", str(tmp_path / "hw.json"),
                 "--config", "configs/tiny.yaml", "--data-path", "data/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moc-plan: error: the calibration run failed (1)")
    assert "Traceback" not in err


def test_unwritable_output_is_a_clean_error(tmp_path, no_measuring, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    assert main(["calibrate", "--dir", str(tmp_path), "--out", str(out),
                 "--iteration-time", "1"]) == 2
    assert f"--out {out}: is a directory" in capsys.readouterr().err
