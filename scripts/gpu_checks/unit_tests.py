"""``cuda_unit_tests``: the tests marked skip-without-CUDA, selected by
``scripts/pytest_cuda_only.py``, under pytest with a JUnit report to count them."""

import glob
import os
import xml.etree.ElementTree as ET

from gpu_checks.common import (FAIL, PASS, REPO, SKIP, CheckResult, Context, child_env, result,
                               run_capped, tail)


def check_cuda_unit_tests(ctx: Context, cap_s: float) -> CheckResult:
    """PASS when every CUDA test of the files that test ``torch.cuda.is_available`` passes;
    SKIP on CPU (they all skip there), FAIL when they skip although CUDA is present."""
    name = "cuda_unit_tests"
    files = sorted(p for p in glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"), recursive=True)
                   if "torch.cuda.is_available" in open(p).read())
    if not files:
        return result(name, FAIL, "no test file checks torch.cuda.is_available")
    log = os.path.join(ctx.work, f"{name}.log")
    junit = os.path.join(ctx.work, "cuda_unit_tests.xml")
    env = child_env({"PYTHONPATH": os.pathsep.join([os.path.join(REPO, "scripts"),
                                                    child_env()["PYTHONPATH"]])})
    rc, timed_out, _ = run_capped(
        [ctx.python, "-m", "pytest", "-q", "-p", "pytest_cuda_only", "-p", "no:cacheprovider",
         f"--junitxml={junit}", *[os.path.relpath(f, REPO) for f in files]], log, cap_s, env)
    if timed_out:
        return result(name, FAIL, f"timed out after {cap_s:.0f} s", files=len(files))
    try:
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except (OSError, ET.ParseError, AttributeError):
        return result(name, FAIL, f"pytest exit {rc}, no report: {tail(log, 3).strip()}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [c.get("name") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    metrics = dict(files=[os.path.relpath(f, REPO) for f in files], passed=passed,
                   failed=failed, skipped=counts["skipped"])
    if failed or rc not in (0, 5):
        return result(name, FAIL, f"{len(failed)} failed: {', '.join(failed[:4])} (pytest exit {rc})",
                      **metrics)
    if passed == 0:
        why = "no CUDA here" if ctx.mode == "cpu" else "skipped although CUDA is available"
        return result(name, SKIP if ctx.mode == "cpu" else FAIL,
                      f"all {counts['skipped']} CUDA tests skipped ({why})", **metrics)
    return result(name, PASS, f"{passed} CUDA tests passed in {len(files)} files", **metrics)
