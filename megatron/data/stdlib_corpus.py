"""The quickstart's corpus: Python standard-library sources as a byte-level indexed
dataset, made once and reused (the accuracy experiment and the exact-mode and
localized-recovery benchmarks train on it)."""

import os
import subprocess
import sys
import sysconfig


def prepare_stdlib_corpus(prefix: str, max_documents: int = 1500, workers: int = 2) -> str:
    """The dataset prefix to pass as ``--data-path`` (``<prefix>_text_document``); its
    files are written by ``python -m megatron.data.preprocess`` when the ``.idx`` is
    missing (the preprocessing's own atomic writes: an interrupted run leaves none).

    Args:
        prefix: output prefix of the dataset (its folder is created).
        max_documents: how many standard-library files to read at most.
        workers: tokenizer processes.

    Raises:
        subprocess.CalledProcessError: the preprocessing failed (its output was shown).
    """
    if not os.path.exists(prefix + "_text_document.idx"):
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
        subprocess.run([sys.executable, "-m", "megatron.data.preprocess",
                        "--input", sysconfig.get_paths()["stdlib"], "--input-ext", ".py",
                        "--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer",
                        "--append-eod", "--workers", str(workers),
                        "--max-documents", str(max_documents),
                        "--exclude-dirs", "site-packages", "dist-packages"],
                       env=env, check=True)
    return prefix + "_text_document"
