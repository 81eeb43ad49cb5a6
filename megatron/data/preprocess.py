"""Tokenize text into Megatron ``.bin``/``.idx`` datasets for pretraining.

Inputs (``--input``, repeatable, each a file, a directory or a glob pattern):

* plain-text files (any extension except ``.jsonl``/``.json``): one document per file,
  read as UTF-8 bytes, so the text (line endings included) round-trips exactly;
* ``.jsonl``/``.json`` files: one JSON object per line, one document per
  ``--json-keys`` key; a ``.json`` file whose content starts with ``[`` is read as one
  JSON array of objects.

Directories are walked recursively for files ending in ``--input-ext`` (hidden files
and directories and ``__pycache__`` are skipped); each directory's or pattern's files
are sorted, so the output does not depend on file-system order. Files that are not
valid UTF-8 are skipped and counted; empty or whitespace-only documents, and documents
shorter than ``--min-doc-chars`` characters, are skipped and counted.

Output, per key (plain-text files count as the first ``--json-keys`` key, ``text`` by
default): ``<output-prefix>_<key>_document.bin`` and ``.idx`` (megatron.core
``IndexedDatasetBuilder``; uint16 tokens for vocabularies under 65500 ids, else int32).
Both files are written under temporary names and renamed only when complete, the old
``.idx`` being removed first, so an interrupted run never leaves a half-written pair
that looks valid.

Example (a directory of Python sources, byte-level tokens, eod after each file)::

    python tools/preprocess_data.py --input src/ --input-ext .py \\
        --output-prefix data/code --tokenizer-type ByteLevelTokenizer --append-eod
    # -> data/code_text_document.bin, data/code_text_document.idx

Bad input exits with status 2 and ``error: ...`` on stderr.

One run (:func:`run_preprocess`, over a :class:`PreprocessConfig`): the files
(:mod:`megatron.data.preprocess_inputs`), one tokenizer in this process or one per pool
worker (:mod:`megatron.data._preprocess_worker`), chunks of documents tokenized there and
appended here to one dataset per key (:mod:`megatron.data.indexed_output`), progress
lines every ``--log-interval`` documents, the datasets committed, a summary.
"""

import argparse
import contextlib
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

from megatron.data._preprocess_worker import encode, init_worker
from megatron.data.indexed_output import IndexedOutputs, optimal_dtype, output_prefix_for
from megatron.data.preprocess_inputs import (
    DEFAULT_INPUT_EXT,
    JSON_EXTENSIONS,
    CorpusStats,
    expand_inputs,
    iter_chunks,
    print_stderr,
)
from megatron.data.tokenizer import (
    DEFAULT_TOKENIZER_TYPE,
    TOKENIZER_TYPES,
    build_tokenizer,
)
from megatron.errors import ConfigError

# Importable from here as before the split into modules.
__all__ = ["DEFAULT_INPUT_EXT", "JSON_EXTENSIONS", "PreprocessConfig", "build_parser",
           "expand_inputs", "main", "main_cli", "output_prefix_for", "preprocess",
           "run_preprocess"]

Log = Callable[[str], None]


def _check_count(value, flag: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")
    return value


def _print_stdout(message: str) -> None:
    print(message, flush=True)


@dataclass
class PreprocessConfig:
    """One preprocessing run, as its command line gives it; checked on creation
    (:class:`ConfigError` naming the flag), the inputs only when the run expands them."""

    inputs: Sequence[str]
    """Files, directories (walked recursively) or glob patterns (``--input``)."""
    output_prefix: str
    """Path prefix of the datasets: ``<prefix>_<key>_document.bin/.idx`` (``--output-prefix``)."""
    tokenizer_type: str = DEFAULT_TOKENIZER_TYPE
    """One of :data:`TOKENIZER_TYPES` (``--tokenizer-type``)."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer's ``vocab.json`` (``--vocab-file``)."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer's ``merges.txt`` (``--merge-file``)."""
    json_keys: Sequence[str] = ("text",)
    """JSON keys tokenized, one dataset each; plain text is the first (``--json-keys``)."""
    input_ext: Union[str, Sequence[str]] = DEFAULT_INPUT_EXT
    """Extensions picked up in directories, comma-separated or a list (``--input-ext``)."""
    append_eod: bool = False
    """Append the end-of-document token to every document (``--append-eod``)."""
    workers: int = 1
    """Tokenizer processes; 1 tokenizes in this process, without a pool (``--workers``)."""
    log_interval: int = 1000
    """Documents between progress lines (``--log-interval``)."""
    max_documents: int = 0
    """Stop after this many input records; 0 reads every one (``--max-documents``)."""
    min_doc_chars: int = 0
    """Skip documents of fewer characters; empty ones always are (``--min-doc-chars``)."""
    vocab_size: Optional[int] = None
    """NullTokenizer's vocabulary size (``--vocab-size``)."""
    exclude_dirs: Sequence[str] = ()
    """Directory names not walked into (``--exclude-dirs``)."""

    def __post_init__(self) -> None:
        self.workers = _check_count(self.workers, "--workers", 1)
        self.log_interval = _check_count(self.log_interval, "--log-interval", 1)
        self.max_documents = _check_count(self.max_documents, "--max-documents", 0)
        self.min_doc_chars = _check_count(self.min_doc_chars, "--min-doc-chars", 0)
        keys = [self.json_keys] if isinstance(self.json_keys, str) else list(self.json_keys)
        if not keys or len(set(keys)) != len(keys):
            raise ConfigError(f"--json-keys must be one or more distinct keys, got {keys!r}")
        for key in keys:
            if not key or "/" in key or os.sep in key:
                raise ConfigError(f"--json-keys: {key!r} cannot be used in a file name")
        self.json_keys = keys
        prefix = self.output_prefix
        if not prefix or prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
            raise ConfigError(
                f"--output-prefix must be a path prefix like data/corpus, got {prefix!r}"
            )
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ConfigError(
                f"--tokenizer-type: unknown tokenizer {self.tokenizer_type!r}; "
                f"choose one of {', '.join(TOKENIZER_TYPES)}"
            )


def preprocess(inputs: Sequence[str], output_prefix: str, *, log: Optional[Log] = None,
               **options) -> dict:
    """Tokenize ``inputs`` into ``<output_prefix>_<key>_document.bin/.idx``.

    ``options`` are the other fields of :class:`PreprocessConfig` (``tokenizer_type``,
    ``json_keys``, ``append_eod``, ``workers``, ...); ``log`` takes each progress line
    (default: printed to stdout). Returns :func:`run_preprocess`'s summary.

    Raises:
        ConfigError: for any problem with the inputs or flags.
    """
    return run_preprocess(PreprocessConfig(inputs, output_prefix, **options), log)


def run_preprocess(config: PreprocessConfig, log: Optional[Log] = None) -> dict:
    """One run: expand the inputs, build the tokenizer, check the output directory, then
    tokenize chunk after chunk (in this process or the pool's workers) into one dataset
    per key, logging progress, and commit the datasets; on any failure (or Ctrl-C) the
    pool is terminated and nothing is written.

    Returns a summary dict: ``files`` (found), ``files_read`` (fewer when
    ``max_documents`` stops early), ``documents`` / ``tokens`` (per key),
    ``outputs`` (per key: dataset prefix), ``bytes`` (UTF-8 text bytes tokenized),
    ``skipped_files`` (not valid UTF-8), ``skipped_documents``, ``seconds``.

    Raises:
        ConfigError: for any problem with the inputs.
    """
    log = log or _print_stdout
    start = time.time()
    files = expand_inputs(config.inputs, config.input_ext, config.exclude_dirs)
    tokenizer = build_tokenizer(config.tokenizer_type, config.vocab_file, config.merge_file,
                                vocab_size=config.vocab_size)
    dtype = optimal_dtype(tokenizer.vocab_size)
    _prepare_output_dir(config.output_prefix)
    log(
        f"preprocessing {len(files)} file(s) with {tokenizer!r}, keys {config.json_keys}, "
        f"append_eod={config.append_eod}, dtype={dtype.__name__}, workers={config.workers}"
    )
    stats, outputs = CorpusStats(), IndexedOutputs(config.output_prefix, dtype)
    progress = ProgressLog(log, config.log_interval, start)
    try:
        with tokenizer_workers(config, dtype.__name__) as encode_texts:
            for chunk in iter_chunks(files, config.json_keys, config.min_doc_chars,
                                     config.max_documents, stats):
                write_chunk(chunk, encode_texts([text for _, text in chunk]), outputs, stats)
                progress.after_chunk(stats, outputs)
            _check_found(config.json_keys, files, outputs, stats)
            outputs.commit()
    except BaseException:
        outputs.discard()
        raise
    summary = _summary(files, outputs, stats, time.time() - start)
    _log_summary(summary, outputs, stats, log)
    return summary


def _prepare_output_dir(output_prefix: str) -> None:
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output-prefix: cannot create {out_dir}: {err.strerror or err}")
    if not os.access(out_dir, os.W_OK):
        raise ConfigError(f"--output-prefix: directory {out_dir} is not writable")


@contextlib.contextmanager
def tokenizer_workers(config: PreprocessConfig,
                      dtype_name: str) -> Iterator[Callable[[List[str]], list]]:
    """A function from texts to their token arrays: in this process with
    ``config.workers == 1``, else through a pool of that many processes, each building
    its own tokenizer (:func:`megatron.data._preprocess_worker.init_worker`)."""
    worker_args = (config.tokenizer_type, config.vocab_file, config.merge_file,
                   config.vocab_size, config.append_eod, dtype_name)
    if config.workers == 1:
        init_worker(*worker_args)
        yield lambda texts: [encode(text) for text in texts]
        return
    pool = multiprocessing.get_context().Pool(
        config.workers, initializer=init_worker, initargs=worker_args
    )
    try:
        yield lambda texts: pool.map(
            encode, texts, chunksize=max(1, len(texts) // (4 * config.workers))
        )
    except BaseException:
        # After a failure the remaining work is not wanted: terminate(). Not on success,
        # where close() lets idle workers exit cleanly (terminate() could kill one while
        # it builds a tokenizer and leave its temporary files behind).
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()


def write_chunk(chunk: List[Tuple[str, str]], encoded: list, outputs: IndexedOutputs,
                stats: CorpusStats) -> None:
    """Append each ``(key, text)`` document's tokens to its key's dataset; a document
    without tokens is skipped and counted."""
    for (key, _), ids in zip(chunk, encoded):
        if len(ids) == 0:
            stats.skipped_documents += 1
            continue
        outputs.add(key, ids)
        stats.documents += 1


class ProgressLog:
    """A ``processed ...`` line whenever a chunk carries the document count past a
    multiple of ``--log-interval``."""

    def __init__(self, log: Log, interval: int, start: float) -> None:
        self.log, self.interval, self.start = log, interval, start
        self.logged = 0

    def after_chunk(self, stats: CorpusStats, outputs: IndexedOutputs) -> None:
        """Called after each chunk is written."""
        if stats.documents // self.interval > self.logged // self.interval:
            elapsed = max(time.time() - self.start, 1e-9)
            self.log(
                f"processed {stats.documents} documents, {outputs.tokens} tokens, "
                f"{stats.bytes / 1e6:.1f} MB in {elapsed:.1f} s "
                f"({stats.bytes / 1e6 / elapsed:.2f} MB/s)"
            )
        self.logged = stats.documents


def _check_found(keys: Sequence[str], files: Sequence[str], outputs: IndexedOutputs,
                 stats: CorpusStats) -> None:
    """Refuse a run that found no document; warn about a key that got none."""
    if not outputs.by_key:
        raise ConfigError(
            f"--input: no documents found in {len(files)} file(s)"
            + (f" ({len(stats.skipped_files)} skipped as not valid UTF-8)"
               if stats.skipped_files else "")
            + (
                f" ({stats.skipped_documents} empty or shorter than --min-doc-chars)"
                if stats.skipped_documents
                else ""
            )
        )
    for key in keys:
        if key not in outputs.by_key:
            print_stderr(f"warning: no documents for key {key!r}; nothing written for it")


def _summary(files: Sequence[str], outputs: IndexedOutputs, stats: CorpusStats,
             seconds: float) -> dict:
    by_key = outputs.by_key
    return {
        "files": len(files),
        "files_read": stats.files_read,
        "documents": {key: o.documents for key, o in by_key.items()},
        "tokens": {key: o.tokens for key, o in by_key.items()},
        "outputs": {key: o.prefix for key, o in by_key.items()},
        "bytes": stats.bytes,
        "skipped_files": stats.skipped_files,
        "skipped_documents": stats.skipped_documents,
        "seconds": seconds,
    }


def _log_summary(summary: dict, outputs: IndexedOutputs, stats: CorpusStats, log: Log) -> None:
    total_docs = sum(summary["documents"].values())
    total_tokens = sum(summary["tokens"].values())
    log(
        f"done: {total_docs} documents, {total_tokens} tokens, {stats.bytes} bytes of text "
        f"from {stats.files_read} of {summary['files']} file(s) in {summary['seconds']:.2f} s"
    )
    for key, output in outputs.by_key.items():
        log(
            f"  {key}: {output.documents} documents, {output.tokens} tokens -> "
            f"{output.bin_path} ({os.path.getsize(output.bin_path)} bytes), {output.idx_path}"
        )
    if stats.skipped_documents:
        log(f"skipped {stats.skipped_documents} empty or too short document(s)")
    if stats.skipped_files:
        print_stderr(
            f"warning: skipped {len(stats.skipped_files)} file(s) that are not valid UTF-8 "
            f"(first: {stats.skipped_files[0]})"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py",
        description="Tokenize text/JSONL into Megatron .bin/.idx datasets.",
    )
    group = parser.add_argument_group("input")
    group.add_argument(
        "--input", nargs="+", action="extend", required=True, metavar="PATH",
        help="files, directories (walked recursively) or glob patterns; repeatable",
    )
    group.add_argument(
        "--input-ext", default=DEFAULT_INPUT_EXT,
        help=f"comma-separated extensions picked up in directories (default {DEFAULT_INPUT_EXT})",
    )
    group.add_argument(
        "--exclude-dirs", nargs="+", default=[],
        help="directory names not walked into (e.g. site-packages test)",
    )
    group.add_argument(
        "--json-keys", nargs="+", default=["text"],
        help="keys of .jsonl/.json objects to tokenize, one output dataset each (default text)",
    )
    group.add_argument(
        "--max-documents", type=int, default=0,
        help="stop after this many input documents (records); 0 = all",
    )
    group.add_argument(
        "--min-doc-chars", type=int, default=0,
        help="skip documents with fewer characters (empty ones are always skipped)",
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument(
        "--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE,
        help=f"one of {', '.join(TOKENIZER_TYPES)} (default {DEFAULT_TOKENIZER_TYPE})",
    )
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    group.add_argument(
        "--append-eod", action="store_true",
        help="append the end-of-document token to each document",
    )
    group = parser.add_argument_group("output")
    group.add_argument(
        "--output-prefix", required=True,
        help="writes <prefix>_<key>_document.bin/.idx",
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes (1 = no pool)")
    group.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress lines"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    """The run :func:`build_parser`'s flags ask for."""
    return PreprocessConfig(
        inputs=args.input,
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        json_keys=args.json_keys,
        input_ext=args.input_ext,
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
        max_documents=args.max_documents,
        min_doc_chars=args.min_doc_chars,
        vocab_size=args.vocab_size,
        exclude_dirs=args.exclude_dirs,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (2 for bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed the usage error
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        run_preprocess(config_from_args(args))
    except ConfigError as err:
        print_stderr(f"error: {err}")
        return ConfigError.exit_code
    except KeyboardInterrupt:
        print_stderr("interrupted; no output written")
        return 130
    return 0


def main_cli() -> None:
    """Console-script entry point (``moc-preprocess-data``)."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
