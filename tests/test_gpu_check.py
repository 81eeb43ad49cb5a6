"""``scripts/gpu_check.sh`` on a machine without a GPU: the summary it writes (to the
summary directory and to ``$OUT``), one PASS/FAIL/SKIP line per check, the reason of
every SKIP, a failed install stopping the checks, and the CUDA-test selection. The GPU
runs themselves happen on a GPU machine (docs/gpu.md)."""

import json
import os
import subprocess
import sys

from tests.launch import REPO

CHECKS = ["cuda_unit_tests", "ranks_per_gpu", "snapshot_bandwidth", "memory_recovery",
          "exact_replay", "checkpoint_stall"]
ENVIRONMENT = {"mode", "device", "date", "commit", "host", "python", "torch", "cuda", "nccl",
               "deepspeed", "megatron_core", "shm_free_gib"}


def _gpu_check(tmp_path, *flags, env=None):
    """Run the script with CUDA hidden; returns (process, the summary from the summary
    directory, the same from $OUT)."""
    out = tmp_path / "out"
    out.mkdir()
    run_env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), CUDA_VISIBLE_DEVICES="",
                   GPU_CHECK_WORK=str(tmp_path / "work"), GPU_CHECK_SITE=str(tmp_path / "site"),
                   **(env or {}))
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *flags, "--summary-dir",
                           str(tmp_path / "summary")], cwd=REPO, env=run_env,
                          capture_output=True, text=True, timeout=120)
    summaries = sorted(os.listdir(tmp_path / "summary"))
    assert len(summaries) == 1 and summaries[0].endswith(".json"), (summaries, proc.stderr)
    name = summaries[0]
    assert (out / name).exists(), os.listdir(out)
    saved = json.load(open(tmp_path / "summary" / name))
    assert json.load(open(out / name)) == saved
    return proc, saved


def _lines(proc):
    return [line for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]


def test_dry_run_writes_the_summary_with_every_check_skipped(tmp_path):
    proc, summary = _gpu_check(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["schema"] == 1 and set(summary["environment"]) == ENVIRONMENT
    env = summary["environment"]
    assert env["mode"] == "dry-run" and env["torch"] and env["date"][:4].isdigit()
    assert env["commit"] and env["deepspeed"]
    assert [c["name"] for c in summary["checks"]] == CHECKS
    assert summary["install"]["status"] == "SKIP"
    assert all(c["status"] == "SKIP" and c["reason"] == "dry run" for c in summary["checks"])
    assert summary["verdict"] == "SKIP"
    assert [line.split(" ")[:2] for line in _lines(proc)] == \
        [["SKIP", "install"]] + [["SKIP", name] for name in CHECKS]


def test_without_cuda_every_check_is_skipped_naming_why(tmp_path):
    """The default mode on a machine without CUDA: the dependencies are importable (the
    test's venv), so nothing is installed, and no check runs."""
    proc, summary = _gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["environment"]["mode"] == "no-cuda" and summary["environment"]["cuda"] is None
    assert summary["install"]["status"] == "PASS"
    assert "already importable" in summary["install"]["reason"]
    for check in summary["checks"]:
        assert check["status"] == "SKIP" and "no CUDA device" in check["reason"], check
    assert sum(1 for line in _lines(proc) if "no CUDA device" in line) == len(CHECKS)
    assert not (tmp_path / "site").exists()


def test_a_failed_install_fails_the_run_and_runs_no_check(tmp_path):
    proc, summary = _gpu_check(tmp_path, "--reinstall",
                               env={"GPU_WHEELS": str(tmp_path / "no-wheels")})
    assert proc.returncode == 1
    assert summary["install"]["status"] == "FAIL"
    assert "scripts/gpu_wheels.sh" in summary["install"]["reason"]
    assert all(c["status"] == "SKIP" and c["reason"] == "the install failed"
               for c in summary["checks"])
    assert summary["verdict"] == "FAIL"
    assert _lines(proc)[0].startswith("FAIL install")


def test_the_cuda_test_plugin_keeps_only_tests_skipped_without_cuda(tmp_path):
    """scripts/pytest_cuda_only.py, as the cuda_unit_tests check loads it: of a file with
    a CUDA-only test, a test skipped for another reason and a plain one, only the first
    is collected (had the others been kept, one would pass and the check would report
    the CPU tests as the CUDA ones)."""
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA GPU')\n"
        "def test_cuda_only(): pass\n"
        "@pytest.mark.skipif(True, reason='needs a second local user')\n"
        "def test_other_skip(): pass\n"
        "def test_plain(): pass\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "scripts"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_cuda_only", "-p",
                           "no:cacheprovider", "-rs", "-v", "test_sample.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    assert "test_cuda_only SKIPPED" in proc.stdout
    assert "test_plain" not in proc.stdout and "test_other_skip" not in proc.stdout
    assert "1 skipped, 2 deselected" in proc.stdout
