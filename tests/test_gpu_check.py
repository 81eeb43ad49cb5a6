"""``scripts/gpu_check.sh`` on a machine without a GPU: the summary it writes (to the
summary directory and to ``$OUT``), one PASS/FAIL/SKIP line per check, the reason of
every SKIP, a failed install stopping the checks, and the CUDA-test selection; and the
stall checks' reading of ``two_level_bench.py``'s rows (built by the benchmark's own
report code from per-rank results of the shape its ranks write), their verdicts and the
benchmark flags they pass. The GPU runs themselves happen on a GPU machine (docs/gpu.md)."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.launch import REPO

CHECKS = ["cuda_unit_tests", "ranks_per_gpu", "snapshot_bandwidth", "memory_recovery",
          "exact_replay", "in_job_restart", "checkpoint_stall", "checkpoint_stall_large"]
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


# ------------------------------------------------- the stall checks and the benchmark's rows

def _module(name, path):
    """A script of the repository as a module (scripts/ and benchmarks/ are no packages)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checks_module(name):
    """A module of scripts/gpu_checks/, imported as scripts/gpu_check.py imports it."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        return importlib.import_module(f"gpu_checks.{name}")
    finally:
        sys.path.remove(os.path.join(REPO, "scripts"))


@pytest.fixture(scope="module")
def stall():
    return _checks_module("stall")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        return _module("two_level_bench_under_test", "benchmarks/two_level_bench.py")
    finally:
        sys.path.remove(os.path.join(REPO, "benchmarks"))


def _timing(step, persist, rank, cuda=False, copy_s=0.010, checksum_s=0.020, save_s=0.004):
    """One rank's SnapshotTiming of one snapshot, as the benchmark keeps it (asdict of the
    real record: a renamed field fails here)."""
    from deepspeed_ext.two_level.records import SnapshotTiming
    return dataclasses.asdict(SnapshotTiming(
        step=step, persist=persist, nbytes=(1 + rank) * 10**9, copies=3 + rank,
        save_s=save_s + rank * 1e-3, slot_wait_s=0.0, host_wait_s=0.0 if cuda else 0.002,
        device_wait_s=0.0005 if cuda else None, copy_s=copy_s, checksum_s=checksum_s + rank * 0.01,
        checksum_threads=4, publish_s=0.001, sealed=True))


def _rank_out(rank, system, saves, interval=1, cuda=False, persist_every=10, timed=True, **kw):
    """One rank's result of one turn, as two_level_bench.py's _run_phase returns it."""
    warmup = [{"tag": f"warmup_step{s}", "step": s, "call_s": 0.3 - 0.1 * s, "wait_s": 0.01}
              for s in (1, 2)]
    call = 1.0 if system == "deepspeed" else 0.005
    records = [{"tag": f"global_step{s}", "step": s, "call_s": call, "wait_s": 0.002,
                "iteration": (s - 4) * interval + interval - 1} for s in range(4, 4 + saves)]
    moc = system.startswith("moc")
    if moc and timed:
        for i, r in enumerate(warmup + records):  # snapshot 0 (a warm-up) persists, then every 10th
            r["timing"] = _timing(r["step"], i % persist_every == 0, rank, cuda, **kw)
    return {"iter_s": [0.1] * (saves * interval), "records": records, "errors": [],
            "warmup_records": warmup,
            "startup": {"setup_s": 2.0 + rank, "prepare_s": 1.5 + rank} if moc else {},
            "ref_iter_s": [0.08] * (saves * interval), "ref_after_iter_s": [0.12] * (saves * interval),
            "drain_s": 0.1, "host_mem_bytes": 3 * 10**9, "turn_s": 9.0,
            "recovery": {"recovery_s": 0.4, "recovery_memory_s": 0.4, "recovery_storage_s": 1.5,
                         "recovered_step": 3 + saves, "load_source": "memory"}}


def _rows(systems, saves=30, world=2, interval=1, ds_saves=5, **kw):
    """The benchmark's rows (its own report code) of synthetic per-rank results."""
    from benchlib.two_level_report import table_rows
    phases = [{"system": s, "interval": interval,
               "per_rank": [_rank_out(r, s, ds_saves if s == "deepspeed" else saves, interval, **kw)
                            for r in range(world)],
               "storage": {"bytes_per_tag": {"global_step13": 10**9}, "uncounted": {}}}
              for s in systems]
    results = {"config": {"params_total": 84_000_000}, "phases": phases,
               "baseline": {"before": [[0.09] * 4] * world, "after": [[0.11] * 4] * world}}
    opts = SimpleNamespace(intervals=str(interval), systems=",".join(systems), iters=saves,
                           min_saves=2, system_iters=f"deepspeed={ds_saves}")
    return table_rows(results, None, opts)


def test_the_benchmark_rows_carry_start_up_warm_up_references_and_stage_medians(bench):
    """A/B/A: the overhead's reference is the mean of the turn's before and after; the
    stages are the max over ranks per save (GB/s the slowest rank's, the device wait None
    on CPU), the warm-up saves apart, persisting saves apart from memory-only ones."""
    rows = {r["system"]: r for r in _rows(["deepspeed", "moc-full"])}
    moc, ds = rows["moc-full"], rows["deepspeed"]
    assert rows["no-checkpoint"]["iter_s_mean_before"] == pytest.approx(0.09)
    assert rows["no-checkpoint"]["iter_s_mean_after"] == pytest.approx(0.11)
    assert moc["ref_iter_s_mean_before"] == pytest.approx(0.08)
    assert moc["ref_iter_s_mean_after"] == pytest.approx(0.12)
    assert moc["iter_overhead"] == pytest.approx(0.1 / 0.10 - 1)
    assert ds["checkpoints"] == 5 and ds["iter_s_mean"] is not None and "stages_median" not in ds
    assert moc["setup_s"] == 3.0 and moc["prepare_s"] == 2.5
    assert moc["prepare_s_per_rank"] == [1.5, 2.5]
    assert moc["warmup_stalls_s"] == pytest.approx([0.21, 0.11]) and moc["warmup_stall_s"] == pytest.approx(0.21)
    assert moc["checkpoints"] == 30 and len(moc["stall_s"]) == 30 and len(moc["save_timings"]) == 30
    assert len(moc["save_timings"][0]) == 2 and moc["save_timings"][0][1]["copies"] == 4
    stages = moc["stages_median"]
    assert stages["save_call"] == pytest.approx(0.005) and stages["copies"] == 4
    assert stages["checksum"] == pytest.approx(0.030) and stages["checksum_threads"] == 4
    assert stages["copy_gb_s"] == pytest.approx(1e9 / 0.010 / 1e9)  # rank 0: 1 GB; rank 1: 2 GB
    assert stages["checksum_gb_s"] == pytest.approx(1e9 / 0.020 / 1e9)
    assert stages["device_wait"] is None and stages["host_wait"] == pytest.approx(0.002)
    # Snapshots 0 and 10, 20, 30 persisted: 0 and 10 are timed saves 8 and 18 of 30
    # (snapshots 2..31 after 2 warm-ups), and 28 (snapshot 30).
    persisted = [i for i, s in enumerate(moc["save_stages"]) if s["persist"]]
    assert persisted == [8, 18, 28]
    assert moc["saves_persist"] == 3 and moc["saves_memory_only"] == 27
    assert moc["stall_s_median_persist"] == pytest.approx(0.007)
    assert moc["stages_median_persist"]["save_call"] == pytest.approx(0.005)
    assert moc["iter_s_mean_persist"] == pytest.approx(0.1)


def test_a_tree_without_stage_timings_gives_rows_without_stages(bench):
    """The before tree of two_level_before_after.py (no TwoLevel.timings): the stall and
    overhead as before, no stage medians, and gpu_check's large check FAILs naming why."""
    rows = _rows(["moc-full"], timed=False)
    moc = rows[1]
    assert moc["stall_s_median"] == pytest.approx(0.007) and moc["stages_median"] is None
    assert moc["save_stages"] == [None] * 30
    ba = _module("before_after_under_test", "benchmarks/two_level_before_after.py")
    assert ba.cell(moc).endswith(", 2.0, -, -")
    with_stages = _rows(["moc-full"])[1]
    assert ba.cell(with_stages) == "7.0, +0.0 %, 2.0, 2.0, 30.0"


def test_the_stall_check_reports_prepare_and_stage_medians(stall, bench):
    rows = _rows(["deepspeed", "moc-full", "moc-pec"], cuda=True)
    status, reason, metrics = stall.stall_verdict(rows)
    assert status == "PASS", reason
    moc = metrics["moc-full"]
    assert moc["prepare_s"] == 2.5 and moc["setup_s"] == 3.0
    assert moc["stages_median"]["device_wait"] == pytest.approx(0.0005)
    assert moc["stages_median"]["host_wait"] == 0.0
    assert moc["warmup_stalls_s"] and len(moc["stall_s"]) == 30 and len(moc["save_stages"]) == 30
    assert moc["stall_s_median_persist"] is not None and moc["saves_persist"] == 3
    assert metrics["deepspeed"]["stages_median"] is None
    assert metrics["iter_s_no_checkpoint_before_after"] == [pytest.approx(0.09), pytest.approx(0.11)]
    assert metrics["targets"] == {"moc-full stall <= 0.5 % of deepspeed's": False,
                                  "moc-full overhead <= +5%": True, "moc-pec overhead <= +2%": True}
    assert "prepare 2.50 s" in reason and "checksum 30.0 ms" in reason
    assert "device wait 0.5 ms" in reason
    json.dumps(metrics)  # the summary is JSON


def test_the_large_state_check_passes_only_within_the_gap_and_the_bandwidth(stall, bench):
    # The stall 7 ms against a 5 ms save call: 2 ms past it; copy 100 GB/s (slowest rank).
    status, reason, metrics = stall.large_stall_verdict(_rows(["moc-full"], interval=4), 110.0)
    assert status == "PASS", reason
    assert metrics["copy_vs_pinned"] == pytest.approx(100 / 110)
    assert metrics["stall_minus_save_call_s"] == pytest.approx(0.002)
    assert metrics["snapshot_bytes"] == 3 * 10**9 and metrics["interval"] == 4
    assert "every 4" in reason and "0.91x" in reason
    status, reason, _ = stall.large_stall_verdict(_rows(["moc-full"], interval=4), 130.0)
    assert status == "FAIL" and "0.77x" in reason  # the copy below 0.8x of pinned
    slow_call = _rows(["moc-full"], interval=4, save_s=0.0001)  # stages' save call 1.1 ms
    status, reason, metrics = stall.large_stall_verdict(slow_call, 110.0)
    assert status == "FAIL" and metrics["stall_minus_save_call_s"] == pytest.approx(0.0059)
    status, reason, _ = stall.large_stall_verdict(_rows(["moc-full"], interval=4), None)
    assert status == "SKIP" and "no pinned reference" in reason
    status, reason, _ = stall.large_stall_verdict(_rows(["moc-full"], interval=4, timed=False), 110.0)
    assert status == "FAIL" and "TwoLevel.timings" in reason


@pytest.mark.parametrize("mode", ["cuda", "cpu"])
def test_the_stall_checks_pass_flags_the_benchmark_accepts(stall, bench, mode):
    """Every flag of both stall checks is one of two_level_bench.py's, with values its
    launcher accepts; on CUDA 30 timed saves every iteration (DeepSpeed 5), and the large
    state 9 GB of fp32 master weights and Adam moments (3 x 4 bytes a parameter)."""
    from benchlib.two_level_peers import parse_system_iters, timed_iters
    main = bench.build_parser().parse_args(stall.stall_flags(mode))
    large = bench.build_parser().parse_args(stall.large_stall_flags(mode))
    for opts in (main, large):
        assert opts.nproc % opts.ep == 0 and opts.num_experts % opts.ep == 0
        assert set(parse_system_iters(opts.system_iters)) <= set(bench.SYSTEMS)
    assert large.systems == "moc-full" and large.no_recovery and large.persist_interval >= 1000
    if mode == "cuda":
        assert timed_iters(main, 1, "moc-full") >= 30 and main.warmup >= 3
        assert timed_iters(main, 1, "deepspeed") == 5
        h, f, layers, experts = large.hidden_size, large.ffn_hidden_size, large.num_layers, large.num_experts
        attention, mlp = 4 * h * h, 2 * h * f
        params = layers // 2 * (attention + mlp) + layers // 2 * (attention + experts * mlp)
        assert 8e9 <= 12 * params <= 16e9, 12 * params
        assert timed_iters(large, int(large.intervals), "moc-full") // int(large.intervals) >= 6


def test_system_iters_parse_and_bound_a_turn(bench):
    from benchlib.two_level_peers import parse_system_iters, timed_iters
    assert parse_system_iters("deepspeed=5, dcp-async=2") == {"deepspeed": 5, "dcp-async": 2}
    assert parse_system_iters("") == {}
    with pytest.raises(ValueError):
        parse_system_iters("deepspeed")
    opts = SimpleNamespace(iters=30, min_saves=10, system_iters="deepspeed=5")
    assert timed_iters(opts, 1, "deepspeed") == 5 and timed_iters(opts, 10, "deepspeed") == 10
    assert timed_iters(opts, 1, "moc-full") == 30 and timed_iters(opts, 10, "moc-full") == 100


def test_the_ranks_probe_counts_a_collective_only_when_both_ranks_ran_it():
    """ranks_per_gpu's merge of its two ranks' reports: one rank's failure wins over the
    other's success, a rank that wrote no report fails every collective, and the reason
    names what is left."""
    ranks = _checks_module("ranks")
    ok = {"init": "ok", "ops": {op: "ok" for op in ranks.PROBE_OPS}}
    broken = {"init": "ok", "ops": dict(ok["ops"], barrier="RuntimeError: timed out")}
    merged = ranks.merge_reports([ok, broken])
    assert merged["init"] == "ok" and merged["ops"]["barrier"] == "RuntimeError: timed out"
    assert ranks.merge_reports([ok, None])["ops"]["all_reduce"] == "rank hung or crashed"
    assert "no rank reported" in ranks.merge_reports([None, None])["init"]
    working = {"gloo": [op for op, s in merged["ops"].items() if s == "ok"]}
    assert ranks.describe({"gloo": merged}, working).startswith("gloo: only all_reduce, ")
    assert ranks.describe({"gloo": ok}, {"gloo": list(ranks.PROBE_OPS)}) == "gloo: every collective"
