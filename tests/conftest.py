"""Shared fixtures: a small real corpus (standard-library sources) in indexed form."""

import os
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


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
    "tests/deepspeed_ext/test_exact.py",
    "tests/training/test_restart.py",
    "tests/deepspeed_ext/test_checkpointer.py",
    "tests/deepspeed_ext/test_two_level.py",
    "tests/deepspeed_ext/test_peers.py",
    "tests/training/test_pipeline_training.py",
    "tests/training/test_tensor_parallel_training.py",
    "tests/training/test_pretrain.py",
    "tests/training/test_startup.py",
    "tests/training/test_megatron_deepspeed_flags.py",
    "tests/training/test_monitor.py",
    "tests/training/test_determinism.py",
)


def pytest_collection_modifyitems(session, config, items):
    order = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(os.path.relpath(str(item.path), REPO), len(order)))
