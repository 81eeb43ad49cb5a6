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
