"""exit_without_teardown: the chosen code reaches the parent, buffered output is not
lost, and the interpreter's teardown (atexit here) does not run."""

import os
import subprocess
import sys

import pytest

from tests.launch import REPO

PROGRAM = """
import atexit, sys
from megatron.training.exit import exit_without_teardown
atexit.register(lambda: print("teardown ran"))
sys.stdout.write("buffered out")   # no newline, no flush: lost without the helper's flush
sys.stderr.write("buffered err")
exit_without_teardown({code})
"""


@pytest.mark.parametrize("code, expected", [(0, 0), (2, 2), (None, 0)])
def test_exit_code_and_flushed_output(code, expected):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as in a job
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(code=code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == expected, proc.stderr
    assert proc.stdout == "buffered out"  # flushed, and the atexit print never happened
    assert proc.stderr == "buffered err"
