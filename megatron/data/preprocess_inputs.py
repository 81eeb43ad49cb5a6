"""The documents of ``tools/preprocess_data.py``'s ``--input``: which files (each
directory or pattern sorted, so the output does not depend on file-system order), their
records (one per plain-text file, one per JSON object), and the chunks handed to the
tokenizer (:func:`iter_chunks`, which also applies ``--min-doc-chars`` and
``--max-documents``). Called in the preprocessing process only, never in its workers.
"""

import codecs
import glob
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Sequence, Tuple

from megatron.errors import ConfigError

DEFAULT_INPUT_EXT = ".txt,.jsonl,.json"
JSON_EXTENSIONS = (".jsonl", ".json")
_SKIPPED_DIRS = {"__pycache__"}
_GLOB_CHARS = set("*?[")
# A chunk goes to the tokenizer at this many documents or bytes, whichever comes first:
# large enough to keep a pool's workers busy, small enough to bound the memory it holds.
_CHUNK_DOCUMENTS = 256
_CHUNK_BYTES = 16 << 20


def print_stderr(message: str) -> None:
    """A warning or error line on stderr, flushed (it interleaves with progress lines)."""
    print(message, file=sys.stderr, flush=True)


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


def is_valid_utf8(path: str) -> bool:
    """Whether the whole file decodes as UTF-8 (read in 1 MiB blocks)."""
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


def iter_file_records(path: str, keys: Sequence[str]) -> Iterator[Dict[str, str]]:
    """Records of one (valid UTF-8) file: dicts key -> document text."""
    if path.lower().endswith(JSON_EXTENSIONS):
        yield from _iter_json_records(path, keys)
    else:
        with open(path, "rb") as f:
            yield {keys[0]: f.read().decode("utf-8")}


@dataclass
class CorpusStats:
    """Counts of one preprocessing run, updated as its documents are read and written."""

    files_read: int = 0
    """Input files opened (fewer than found when ``--max-documents`` stops early)."""
    records: int = 0
    """Records (plain-text files, JSON objects) with at least one document kept."""
    documents: int = 0
    """Documents written (non-empty after tokenizing)."""
    bytes: int = 0
    """UTF-8 bytes of the documents handed to the tokenizer."""
    skipped_documents: int = 0
    """Documents empty, whitespace-only, shorter than ``--min-doc-chars``, not encodable
    as UTF-8 (lone surrogates from JSON escapes), or with no tokens."""
    skipped_files: List[str] = field(default_factory=list)
    """Files skipped as not valid UTF-8."""


def _iter_records(files: Sequence[str], keys: Sequence[str],
                  stats: CorpusStats) -> Iterator[Dict[str, str]]:
    """The records of ``files`` in order; a file that is not valid UTF-8 is skipped with
    a warning on stderr."""
    for path in files:
        stats.files_read += 1
        if not is_valid_utf8(path):
            stats.skipped_files.append(path)
            print_stderr(f"warning: skipping {path}: not valid UTF-8")
            continue
        yield from iter_file_records(path, keys)


def iter_chunks(files: Sequence[str], keys: Sequence[str], min_doc_chars: int,
                max_documents: int, stats: CorpusStats) -> Iterator[List[Tuple[str, str]]]:
    """Chunks of ``(key, text)`` documents of ``files`` for the tokenizer, in input order.

    Skips (and counts in ``stats``) documents that are empty, whitespace-only, shorter
    than ``min_doc_chars`` or not encodable as UTF-8; stops after ``max_documents``
    records (0: none). Files are opened lazily: the consumer writes each chunk before
    the next file is read.
    """
    chunk: List[Tuple[str, str]] = []
    chunk_bytes = 0
    for record in _iter_records(files, keys, stats):
        accepted = 0
        for key, text in record.items():
            if not text.strip() or len(text) < min_doc_chars:
                stats.skipped_documents += 1
                continue
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError:  # lone surrogates from JSON escapes
                stats.skipped_documents += 1
                continue
            chunk.append((key, text))
            chunk_bytes += size
            stats.bytes += size
            accepted += 1
        if accepted:
            stats.records += 1
        if len(chunk) >= _CHUNK_DOCUMENTS or chunk_bytes >= _CHUNK_BYTES:
            yield chunk
            chunk, chunk_bytes = [], 0
        if max_documents and stats.records >= max_documents:
            break
    if chunk:
        yield chunk
