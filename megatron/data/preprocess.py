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
"""

import argparse
import codecs
import glob
import json
import multiprocessing
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence


from megatron.data.tokenizer import (
    DEFAULT_TOKENIZER_TYPE,
    TOKENIZER_TYPES,
    build_tokenizer,
)
from megatron.data._preprocess_worker import encode as _encode
from megatron.data._preprocess_worker import init_worker as _init_worker
from megatron.errors import ConfigError

DEFAULT_INPUT_EXT = ".txt,.jsonl,.json"
JSON_EXTENSIONS = (".jsonl", ".json")
_SKIPPED_DIRS = {"__pycache__"}
_GLOB_CHARS = set("*?[")
_CHUNK_DOCUMENTS = 256
_CHUNK_BYTES = 16 << 20


# ----------------------------------------------------------------------------- inputs


def _parse_extensions(input_ext) -> List[str]:
    if isinstance(input_ext, str):
        input_ext = input_ext.split(",")
    exts = []
    for ext in input_ext:
        ext = ext.strip()
        if not ext:
            continue
        exts.append((ext if ext.startswith(".") else "." + ext).lower())
    if not exts:
        raise ConfigError(f"--input-ext needs at least one extension, got {input_ext!r}")
    return exts


def _walk(directory: str, exts: Sequence[str], exclude_dirs: Sequence[str] = ()) -> List[str]:
    found = []
    skipped = _SKIPPED_DIRS | set(exclude_dirs)
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skipped]
        for name in files:
            if not name.startswith(".") and name.lower().endswith(tuple(exts)):
                found.append(os.path.join(root, name))
    return sorted(found)


def expand_inputs(inputs: Sequence[str], input_ext=DEFAULT_INPUT_EXT,
                  exclude_dirs: Sequence[str] = ()) -> List[str]:
    """Files named by ``--input`` items, in order; each directory/pattern sorted."""
    exts = _parse_extensions(input_ext)
    if not inputs:
        raise ConfigError("--input is required (files, directories or glob patterns)")
    files: List[str] = []
    for item in inputs:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"--input: empty path {item!r}")
        if os.path.isdir(item):
            matched = _walk(item, exts, exclude_dirs)
            if not matched:
                raise ConfigError(
                    f"--input: no files ending in {','.join(exts)} under directory {item} "
                    "(see --input-ext)"
                )
        elif os.path.isfile(item):
            matched = [item]
        elif _GLOB_CHARS & set(item):
            matched = []
            for path in sorted(glob.glob(item, recursive=True)):
                if os.path.isdir(path):
                    matched.extend(_walk(path, exts, exclude_dirs))
                elif os.path.isfile(path):
                    matched.append(path)
            if not matched:
                raise ConfigError(f"--input: pattern {item!r} matches no files")
        else:
            raise ConfigError(f"--input: no such file or directory: {item}")
        files.extend(matched)

    unique, seen = [], set()
    for path in files:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    for path in unique:
        if not os.access(path, os.R_OK):
            raise ConfigError(f"--input: cannot read {path}")
    return unique


def _is_valid_utf8(path: str) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(1 << 20)
                if not block:
                    decoder.decode(b"", final=True)
                    return True
                decoder.decode(block)
    except UnicodeDecodeError:
        return False


def _json_field(obj, key: str, where: str) -> str:
    if key not in obj:
        raise ConfigError(f"{where}: no key {key!r} (see --json-keys)")
    value = obj[key]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: key {key!r} must be a string, got {type(value).__name__}")
    return value


def _iter_json_records(path: str, keys: Sequence[str]) -> Iterator[Dict[str, str]]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if path.lower().endswith(".json") and head.startswith(b"["):
        with open(path, "r", encoding="utf-8-sig") as f:
            try:
                array = json.load(f)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{path}:{err.lineno}: invalid JSON ({err.msg}, column {err.colno})"
                ) from None
        if not isinstance(array, list):
            raise ConfigError(f"{path}: expected a JSON array of objects")
        for position, obj in enumerate(array):
            where = f"{path}: element {position}"
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield {key: _json_field(obj, key, where) for key in keys}
        return

    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.decode("utf-8")
            if lineno == 1:
                line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{where}: invalid JSON ({err.msg}, column {err.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield {key: _json_field(obj, key, where) for key in keys}


def _iter_file_records(path: str, keys: Sequence[str]) -> Iterator[Dict[str, str]]:
    """Records of one (valid UTF-8) file: dicts key -> document text."""
    if path.lower().endswith(JSON_EXTENSIONS):
        yield from _iter_json_records(path, keys)
    else:
        with open(path, "rb") as f:
            yield {keys[0]: f.read().decode("utf-8")}


# --------------------------------------------------------------------------- output


class _AtomicIndexedDataset:
    """An IndexedDatasetBuilder writing to temporary names, renamed on commit."""

    def __init__(self, prefix: str, dtype) -> None:
        from megatron.data._compat import quiet_core_import

        with quiet_core_import():
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = prefix
        self.bin_path, self.idx_path = prefix + ".bin", prefix + ".idx"
        suffix = f".tmp-{os.getpid()}"
        self.tmp_bin, self.tmp_idx = self.bin_path + suffix, self.idx_path + suffix
        self.builder = IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)
        self.documents = 0
        self.tokens = 0

    def add(self, ids) -> None:
        self.builder.add_document(ids, [len(ids)])
        self.documents += 1
        self.tokens += len(ids)

    def commit(self) -> None:
        self.builder.finalize(self.tmp_idx)
        for path in (self.tmp_bin, self.tmp_idx):
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        # Remove the old index first: between the two renames the pair is incomplete
        # (no .idx), never a new .bin with a stale .idx.
        if os.path.lexists(self.idx_path):
            os.remove(self.idx_path)
        os.replace(self.tmp_bin, self.bin_path)
        os.replace(self.tmp_idx, self.idx_path)
        try:
            fd = os.open(os.path.dirname(os.path.abspath(self.bin_path)), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass

    def discard(self) -> None:
        try:
            self.builder.data_file.close()
        except Exception:
            pass
        for path in (self.tmp_bin, self.tmp_idx):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron naming: ``<output-prefix>_<key>_document``."""
    return f"{output_prefix}_{key}_document"


# ----------------------------------------------------------------------------- driver


def _check_count(value, flag: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")
    return value


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_type: str = DEFAULT_TOKENIZER_TYPE,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    json_keys: Sequence[str] = ("text",),
    input_ext=DEFAULT_INPUT_EXT,
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 1000,
    max_documents: int = 0,
    min_doc_chars: int = 0,
    vocab_size: Optional[int] = None,
    log: Optional[Callable[[str], None]] = None,
    exclude_dirs: Sequence[str] = (),
) -> dict:
    """Tokenize ``inputs`` into ``<output_prefix>_<key>_document.bin/.idx``.

    Returns a summary dict: ``files`` (found), ``files_read`` (fewer when
    ``max_documents`` stops early), ``documents`` / ``tokens`` (per key),
    ``outputs`` (per key: dataset prefix), ``bytes`` (UTF-8 text bytes tokenized),
    ``skipped_files`` (not valid UTF-8), ``skipped_documents``, ``seconds``.

    Raises:
        ConfigError: for any problem with the inputs or flags.
    """
    log = log or (lambda message: print(message, flush=True))
    start = time.time()
    workers = _check_count(workers, "--workers", 1)
    log_interval = _check_count(log_interval, "--log-interval", 1)
    max_documents = _check_count(max_documents, "--max-documents", 0)
    min_doc_chars = _check_count(min_doc_chars, "--min-doc-chars", 0)
    if isinstance(json_keys, str):
        json_keys = [json_keys]
    json_keys = list(json_keys)
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise ConfigError(f"--json-keys must be one or more distinct keys, got {json_keys!r}")
    for key in json_keys:
        if not key or "/" in key or os.sep in key:
            raise ConfigError(f"--json-keys: {key!r} cannot be used in a file name")
    if not output_prefix or output_prefix.endswith(("/", os.sep)) or os.path.isdir(output_prefix):
        raise ConfigError(
            f"--output-prefix must be a path prefix like data/corpus, got {output_prefix!r}"
        )
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(
            f"--tokenizer-type: unknown tokenizer {tokenizer_type!r}; "
            f"choose one of {', '.join(TOKENIZER_TYPES)}"
        )

    files = expand_inputs(inputs, input_ext, exclude_dirs)
    tokenizer = build_tokenizer(tokenizer_type, vocab_file, merge_file, vocab_size=vocab_size)

    from megatron.data._compat import quiet_core_import

    with quiet_core_import():
        from megatron.core.datasets.indexed_dataset import DType
    dtype = DType.optimal_dtype(tokenizer.vocab_size)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output-prefix: cannot create {out_dir}: {err.strerror or err}")
    if not os.access(out_dir, os.W_OK):
        raise ConfigError(f"--output-prefix: directory {out_dir} is not writable")

    log(
        f"preprocessing {len(files)} file(s) with {tokenizer!r}, keys {json_keys}, "
        f"append_eod={append_eod}, dtype={dtype.__name__}, workers={workers}"
    )
    worker_args = (tokenizer_type, vocab_file, merge_file, vocab_size, append_eod, dtype.__name__)
    outputs = {}
    pool = None
    committed = False
    skipped_files: List[str] = []
    stats = {
        "records": 0, "documents": 0, "bytes": 0, "skipped_documents": 0, "logged": 0,
        "files_read": 0,
    }

    def write_chunk(chunk_keys: List[str], chunk_texts: List[str]) -> None:
        if pool is None:
            encoded = [_encode(text) for text in chunk_texts]
        else:
            chunksize = max(1, len(chunk_texts) // (4 * workers))
            encoded = pool.map(_encode, chunk_texts, chunksize=chunksize)
        for key, ids in zip(chunk_keys, encoded):
            if len(ids) == 0:
                stats["skipped_documents"] += 1
                continue
            if key not in outputs:
                outputs[key] = _AtomicIndexedDataset(output_prefix_for(output_prefix, key), dtype)
            outputs[key].add(ids)
            stats["documents"] += 1
        if stats["documents"] // log_interval > stats["logged"] // log_interval:
            elapsed = max(time.time() - start, 1e-9)
            tokens = sum(o.tokens for o in outputs.values())
            log(
                f"processed {stats['documents']} documents, {tokens} tokens, "
                f"{stats['bytes'] / 1e6:.1f} MB in {elapsed:.1f} s "
                f"({stats['bytes'] / 1e6 / elapsed:.2f} MB/s)"
            )
        stats["logged"] = stats["documents"]

    try:
        if workers > 1:
            pool = multiprocessing.get_context().Pool(
                workers, initializer=_init_worker, initargs=worker_args
            )
        else:
            _init_worker(*worker_args)

        chunk_keys: List[str] = []
        chunk_texts: List[str] = []
        chunk_bytes = 0
        done = False
        for path in files:
            if done:
                break
            stats["files_read"] += 1
            if not _is_valid_utf8(path):
                skipped_files.append(path)
                _stderr(f"warning: skipping {path}: not valid UTF-8")
                continue
            for record in _iter_file_records(path, json_keys):
                accepted = 0
                for key, text in record.items():
                    if not text.strip() or len(text) < min_doc_chars:
                        stats["skipped_documents"] += 1
                        continue
                    try:
                        size = len(text.encode("utf-8"))
                    except UnicodeEncodeError:  # lone surrogates from JSON escapes
                        stats["skipped_documents"] += 1
                        continue
                    chunk_keys.append(key)
                    chunk_texts.append(text)
                    chunk_bytes += size
                    stats["bytes"] += size
                    accepted += 1
                if accepted:
                    stats["records"] += 1
                if len(chunk_texts) >= _CHUNK_DOCUMENTS or chunk_bytes >= _CHUNK_BYTES:
                    write_chunk(chunk_keys, chunk_texts)
                    chunk_keys, chunk_texts, chunk_bytes = [], [], 0
                if max_documents and stats["records"] >= max_documents:
                    done = True
                    break
        if chunk_texts:
            write_chunk(chunk_keys, chunk_texts)

        if not outputs:
            raise ConfigError(
                f"--input: no documents found in {len(files)} file(s)"
                + (f" ({len(skipped_files)} skipped as not valid UTF-8)" if skipped_files else "")
                + (
                    f" ({stats['skipped_documents']} empty or shorter than --min-doc-chars)"
                    if stats["skipped_documents"]
                    else ""
                )
            )
        for key in json_keys:
            if key not in outputs:
                _stderr(f"warning: no documents for key {key!r}; nothing written for it")
        for output in outputs.values():
            output.commit()
        committed = True
    finally:
        if pool is not None:
            # close() lets idle workers exit cleanly (terminate() could kill one while
            # it builds a tokenizer and leave its temporary files behind); after a
            # failure the remaining work is not wanted, so terminate() then.
            if committed:
                pool.close()
            else:
                pool.terminate()
            pool.join()
        if not committed:
            for output in outputs.values():
                output.discard()

    seconds = time.time() - start
    summary = {
        "files": len(files),
        "files_read": stats["files_read"],
        "documents": {key: o.documents for key, o in outputs.items()},
        "tokens": {key: o.tokens for key, o in outputs.items()},
        "outputs": {key: o.prefix for key, o in outputs.items()},
        "bytes": stats["bytes"],
        "skipped_files": skipped_files,
        "skipped_documents": stats["skipped_documents"],
        "seconds": seconds,
    }
    total_docs = sum(summary["documents"].values())
    total_tokens = sum(summary["tokens"].values())
    log(
        f"done: {total_docs} documents, {total_tokens} tokens, {stats['bytes']} bytes of text "
        f"from {stats['files_read']} of {len(files)} file(s) in {seconds:.2f} s"
    )
    for key, output in outputs.items():
        log(
            f"  {key}: {output.documents} documents, {output.tokens} tokens -> "
            f"{output.bin_path} ({os.path.getsize(output.bin_path)} bytes), {output.idx_path}"
        )
    if stats["skipped_documents"]:
        log(f"skipped {stats['skipped_documents']} empty or too short document(s)")
    if skipped_files:
        _stderr(
            f"warning: skipped {len(skipped_files)} file(s) that are not valid UTF-8 "
            f"(first: {skipped_files[0]})"
        )
    return summary


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (2 for bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed the usage error
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        preprocess(
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
    except ConfigError as err:
        _stderr(f"error: {err}")
        return ConfigError.exit_code
    except KeyboardInterrupt:
        _stderr("interrupted; no output written")
        return 130
    return 0


def main_cli() -> None:
    """Console-script entry point (``moc-preprocess-data``)."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
