"""Shared fixtures (a small real corpus), the order of long files, and the ``e2e`` marker:
the rule that sets it (:mod:`tests.process_rule`) and the guard of the fast subset
(:mod:`tests.process_guard`), applied here at collection and around every test.
"""

import os
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.process_guard import GUARD  # noqa: E402  (after the path above)
from tests.process_rule import RULE, CodeIndex, item_reason  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Indexed-dataset prefix of ~300 Python standard-library files, byte-level tokens."""
    out = tmp_path_factory.mktemp("corpus")
    prefix = str(out / "stdlib")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
                    "--input", sysconfig.get_paths()["stdlib"], "--input-ext", ".py",
                    "--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer",
                    "--append-eod", "--workers", "1", "--max-documents", "300",
                    "--exclude-dirs", "site-packages", "dist-packages"],
                   check=True, cwd=REPO, capture_output=True, text=True)
    return prefix + "_text_document"


# The files of long end-to-end jobs (multi-rank runs with crashes and restarts), longest
# first. scripts/test.sh runs the suite on 2 workers, each taking one whole file at a time
# in collection order; taken last, one of these kept a worker busy for minutes after the
# other had finished. Only the order changes (a stable sort: the rest keep theirs).
LONGEST_FIRST = (
    "tests/deepspeed_ext/exact/test_exact.py",
    "tests/training/test_restart.py",
    "tests/deepspeed_ext/test_checkpointer.py",
    "tests/deepspeed_ext/two_level/test_two_level.py",
    "tests/deepspeed_ext/test_peers.py",
    "tests/training/test_pipeline_training.py",
    "tests/training/test_tensor_parallel_training.py",
    "tests/training/test_mixtral_shape.py",
    "tests/training/test_pretrain.py",
    "tests/training/test_startup.py",
    "tests/training/test_megatron_deepspeed_flags.py",
    "tests/training/test_monitor.py",
    "tests/training/test_determinism.py",
)

# ---------------------------------------------------------------------------------------
# The e2e mark (tests.process_rule) and the fast subset's guard (tests.process_guard).

def pytest_deselected(items):
    RULE.deselected.extend(items)


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m
def pytest_collection_modifyitems(session, config, items):
    order = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(os.path.relpath(str(item.path), REPO), len(order)))
    index = RULE.index = CodeIndex()
    for item in items:
        if item.get_closest_marker("e2e") is None:
            why = item_reason(index, item)
            if why:
                item.add_marker(pytest.mark.e2e(reason=why))


def pytest_collection_finish(session):
    """Arm the guard when no collected test is marked e2e (``--fast``, a pure file)."""
    if session.items and not any(i.get_closest_marker("e2e") for i in session.items):
        GUARD.arm()


def _guarded(item):
    GUARD.started = []
    result = yield
    if GUARD.active:
        GUARD.check(item)
    return result


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_guarded)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_guarded)
pytest_runtest_teardown = pytest.hookimpl(wrapper=True)(_guarded)

