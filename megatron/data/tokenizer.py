"""Tokenizers for pretraining, built on ``megatron.core.tokenizers``.

:func:`build_tokenizer` returns a :class:`Tokenizer`: a thin wrapper around the
megatron.core tokenizer object that fixes the few things the training and data code
rely on:

* ``vocab_size`` / ``eod`` are plain ints;
* ``pad`` is ``-1`` (:data:`NO_PAD_ID`): none of these tokenizers has a padding token
  distinct from the end-of-document token, and megatron.core's ``GPTDataset`` treats
  a pad id equal to eod as a collision (it warns and falls back to ``-1`` anyway);
  ``-1`` never occurs in token data, so nothing real is ever masked as padding;
* ``unique_identifiers`` is deterministic across ranks and runs: megatron.core hashes
  it into the dataset index cache key.

Byte-level tokenizer
--------------------
megatron.core's ``ByteLevelTokenizer`` defaults to ``vocab_size=512``, ``eos=0`` and
``pad=1``, i.e. the end-of-document id would collide with the bytes 0x00/0x01. Here it
is configured with ``vocab_size=256`` plus ONE special token ``<eod>``; the library
places special tokens at the end of the vocabulary, so the id of ``<eod>`` is 256 and
the vocabulary has 257 entries; ``_eos_id`` (what ``.eod`` returns) is set to 256 too.
The library's ``ids_to_text`` strips trailing whitespace (``rstrip``), so
:meth:`Tokenizer.detokenize` decodes bytes itself for an exact round trip. The library
tokenizer is built on the first :meth:`Tokenizer.tokenize` (or ``.core``): importing
``megatron.core.tokenizers`` imports HuggingFace ``transformers`` (about 2.5 s of CPU),
and a trainer, which needs only ``vocab_size`` and ``eod``, never tokenizes.

GPT-2 BPE tokenizer
-------------------
Built from a local GPT-2 ``vocab.json`` (``--vocab-file``) and ``merges.txt``
(``--merge-file``) with megatron.core's ``"huggingface"`` library, fully offline;
see :func:`_gpt2_core_from_files` for why it goes through a private temporary
directory.
The end-of-document id is the id of ``<|endoftext|>`` in ``vocab.json``. A literal
``<|endoftext|>`` inside the text is tokenized as ordinary text (as the original
Megatron-LM GPT-2 tokenizer does), so documents cannot inject end-of-document ids.
Needs ``transformers`` (the ``[bpe]`` extra).
"""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import threading
from collections import OrderedDict
from typing import Callable, Iterable, List, Optional

from megatron.data.compat import check_int, quiet_core_import
from megatron.errors import ConfigError

TOKENIZER_TYPES = ("ByteLevelTokenizer", "GPT2BPETokenizer", "NullTokenizer")
DEFAULT_TOKENIZER_TYPE = "ByteLevelTokenizer"

NO_PAD_ID = -1
BYTE_LEVEL_EOD = 256
BYTE_LEVEL_VOCAB_SIZE = 257

GPT2_EOD_TOKEN = "<|endoftext|>"


class Tokenizer:
    """What the trainer and datasets need from a tokenizer.

    Attributes:
        tokenizer_type: one of :data:`TOKENIZER_TYPES`.
        core: the underlying ``megatron.core.tokenizers`` object (built on first use
            when the tokenizer was made with ``build_core``).
        vocab_size: number of token ids (embedding rows needed), eod included.
        eod: id of the end-of-document token.
        pad: :data:`NO_PAD_ID` (no distinct padding token).
    """

    def __init__(
        self,
        tokenizer_type: str,
        core,
        vocab_size: int,
        eod: int,
        vocab_file: Optional[str] = None,
        merge_file: Optional[str] = None,
        build_core: Optional[Callable[[], object]] = None,
    ) -> None:
        self.tokenizer_type = tokenizer_type
        self._core = core
        self._build_core = build_core
        self._vocab_size = int(vocab_size)
        self._eod = int(eod)
        self.vocab_file = vocab_file
        self.merge_file = merge_file

    @property
    def core(self):
        if self._core is None and self._build_core is not None:
            self._core = self._build_core()
        return self._core

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        """Same as :attr:`eod` (megatron.core checks ``eos`` for pad collisions)."""
        return self._eod

    @property
    def pad(self) -> int:
        return NO_PAD_ID

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        """Deterministic description used by megatron.core in dataset cache keys."""
        ids = OrderedDict()
        ids["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        ids["tokenizer_type"] = self.tokenizer_type
        ids["vocab_size"] = self._vocab_size
        ids["eod"] = self._eod
        ids["vocab_file"] = os.path.abspath(self.vocab_file) if self.vocab_file else None
        ids["merge_file"] = os.path.abspath(self.merge_file) if self.merge_file else None
        return ids

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` (no end-of-document token is added)."""
        if not isinstance(text, str):
            raise TypeError(f"tokenize() expects str, got {type(text).__name__}")
        ids = self.core.tokenize(text)
        return ids if isinstance(ids, list) else [int(i) for i in ids]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; end-of-document tokens are dropped."""
        ids = [int(i) for i in ids]
        if self.tokenizer_type == "ByteLevelTokenizer":
            bad = [i for i in ids if not 0 <= i < self._vocab_size]
            if bad:
                raise ValueError(
                    f"token id {bad[0]} is outside the byte-level vocabulary "
                    f"[0, {self._vocab_size})"
                )
            # Not core.detokenize: it rstrip()s the text, which breaks exact round trips.
            return bytes(i for i in ids if i != self._eod).decode("utf-8", errors="replace")
        if self.tokenizer_type == "GPT2BPETokenizer":
            bad = [i for i in ids if not 0 <= i < self._vocab_size]
            if bad:  # HuggingFace would fail with an obscure TypeError instead
                raise ValueError(
                    f"token id {bad[0]} is outside the GPT-2 vocabulary [0, {self._vocab_size})"
                )
        return self.core.detokenize([i for i in ids if i != self._eod])

    def __repr__(self) -> str:
        return (
            f"Tokenizer(type={self.tokenizer_type}, vocab_size={self._vocab_size}, "
            f"eod={self._eod})"
        )


def core_tokenizer_class():
    """megatron.core's ``MegatronTokenizer`` class, imported without its import-time noise.

    Called by every tokenizer builder of this module, each time it builds; tests
    replace it with a fake class.
    """
    with quiet_core_import():
        from megatron.core.tokenizers import MegatronTokenizer
    return MegatronTokenizer


def _check_readable_file(path: Optional[str], flag: str, tokenizer_type: str) -> str:
    if not path:
        raise ConfigError(f"{flag} is required for --tokenizer-type {tokenizer_type}")
    if not os.path.exists(path):
        raise ConfigError(f"{flag}: file not found: {path}")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag}: not a regular file: {path}")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        raise ConfigError(f"{flag}: cannot read {path}: {err.strerror or err}") from None
    return path


def _build_byte_level() -> Tokenizer:
    return Tokenizer("ByteLevelTokenizer", None, BYTE_LEVEL_VOCAB_SIZE, BYTE_LEVEL_EOD,
                     build_core=_byte_level_core)


def _byte_level_core():
    """megatron.core's ByteLevelTokenizer, checked to assign the ids the wrapper states."""
    core = core_tokenizer_class().from_pretrained(
        metadata_path={"library": "byte-level", "model_type": "gpt"},
        # 256 byte ids, then the one special token appended at the end -> id 256.
        vocab_size=256,
        special_tokens=["<eod>"],
        _eos_id=BYTE_LEVEL_EOD,
        _pad_id=BYTE_LEVEL_EOD,
        _bos_id=None,
    )
    # Guard the arithmetic above against a change in megatron.core's id assignment.
    library = core._tokenizer
    if (
        core.vocab_size != BYTE_LEVEL_VOCAB_SIZE
        or core.eod != BYTE_LEVEL_EOD
        or library.token_to_id("<eod>") != BYTE_LEVEL_EOD
    ):
        raise RuntimeError(
            "megatron.core ByteLevelTokenizer assigned unexpected ids "
            f"(vocab_size={core.vocab_size}, eod={core.eod}, "
            f"<eod>={library.token_to_id('<eod>')}); expected 257/256/256"
        )
    return core


def have_transformers() -> bool:
    """Whether HuggingFace ``transformers`` is importable.

    Called by the GPT-2 BPE builder before it builds (any rank, any preprocessing
    worker); tests replace it to build without ``transformers``.
    """
    return importlib.util.find_spec("transformers") is not None


def _read_gpt2_vocab(vocab_file: str) -> dict:
    """Parse and sanity-check a GPT-2 ``vocab.json`` (token -> id)."""
    try:
        with open(vocab_file, "r", encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (invalid JSON: {err})"
        ) from None
    except OSError as err:
        raise ConfigError(
            f"--vocab-file: cannot read {vocab_file}: {err.strerror or err}"
        ) from None
    if not isinstance(vocab, dict) or not vocab:
        raise ConfigError(
            f"--vocab-file {vocab_file}: not a GPT-2 vocab.json "
            "(expected a non-empty JSON object mapping tokens to ids)"
        )
    for token, token_id in vocab.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ConfigError(
                f"--vocab-file {vocab_file}: token {token!r} has id {token_id!r}; "
                "ids must be non-negative integers"
            )
    if GPT2_EOD_TOKEN not in vocab:
        raise ConfigError(
            f"--vocab-file {vocab_file}: the GPT-2 vocabulary has no end-of-text token "
            f"{GPT2_EOD_TOKEN!r} (needed as the end-of-document id)"
        )
    return vocab


# tokenizer_config.json of the private directory handed to HuggingFace AutoTokenizer.
_GPT2_TOKENIZER_CONFIG = {
    # AutoTokenizer needs the class: without it, it looks for a model config.json.
    # "GPT2Tokenizer" with use_fast=True resolves to GPT2TokenizerFast on transformers
    # 4.x and to GPT2Tokenizer (which is Rust-backed there) on 5.x.
    "tokenizer_class": "GPT2Tokenizer",
    # GPT-2's own settings (also the class defaults), spelled out so they do not depend
    # on the transformers version.
    "add_prefix_space": False,
    "errors": "replace",
    "bos_token": GPT2_EOD_TOKEN,
    "eos_token": GPT2_EOD_TOKEN,
    "unk_token": GPT2_EOD_TOKEN,
    # A literal "<|endoftext|>" in a document is text, not the end-of-document id
    # (the original Megatron-LM GPT-2 tokenizer behaves the same way).
    "split_special_tokens": True,
}


def _link_or_copy(src: str, dst: str) -> None:
    """Symlink ``dst`` to ``src`` (nothing to copy, nothing big left behind if a killed
    process skips the clean-up); copy where symlinks are not available."""
    try:
        os.symlink(os.path.abspath(src), dst)
    except (OSError, NotImplementedError):
        shutil.copyfile(src, dst)


class Terminated(BaseException):
    """SIGTERM arrived inside :func:`_sigterm_cleans_up` (not an ``Exception``, so the
    ``except Exception`` clauses on the way out do not swallow it).

    Raised by that context's signal handler; it never reaches a caller of
    :func:`build_tokenizer` in a real process (the re-sent SIGTERM ends it first). Tests
    that fake ``os.kill`` catch it.
    """


@contextlib.contextmanager
def _sigterm_cleans_up():
    """Let ``with`` blocks inside run their clean-up if SIGTERM arrives, then die of it.

    SIGTERM's default action kills the process on the spot, skipping ``finally`` and
    ``__exit__``: a ``multiprocessing.Pool`` worker terminated (``Pool.terminate()``,
    as the preprocessing tool does when it is done) while still building its
    tokenizer, or a rank stopped by its launcher, would leave the temporary directory
    behind. Only while SIGTERM has its default action and only in the main thread
    (signal handlers cannot be set elsewhere), a handler turns it into
    :class:`Terminated`; on the way out the default action is restored and the signal
    re-sent, so the process still ends as killed by SIGTERM.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    state = {"armed": True, "received": False}

    def handler(signum, frame):
        state["received"] = True
        if state["armed"]:
            raise Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        state["armed"] = False
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if state["received"]:
            os.kill(os.getpid(), signal.SIGTERM)


def _build_gpt2_bpe(vocab_file: Optional[str], merge_file: Optional[str]) -> Tokenizer:
    """GPT-2 byte-level BPE from local files, through megatron.core, offline.

    Checks the files and ``transformers`` (:func:`_read_gpt2_inputs`), builds the library
    tokenizer (:func:`_gpt2_core_from_files`, which says why through a private temporary
    directory), then checks that its eod is the file's and that a literal
    ``<|endoftext|>`` stays text (:func:`_check_gpt2_core`).

    Checked with transformers 4.43.4, 4.46.3, 4.57.6 and 5.23.0; 4.41 and older are
    rejected (their fast tokenizers ignore ``split_special_tokens``).
    """
    vocab = _read_gpt2_inputs(vocab_file, merge_file)
    try:
        core = _gpt2_core_from_files(vocab_file, merge_file)
        vocab_size, eod = core.vocab_size, core.eod
        # transformers < 4.43 ignores split_special_tokens for fast tokenizers.
        literal_eod_ok = eod not in core.tokenize(GPT2_EOD_TOKEN)
    except ConfigError:
        raise
    except Exception as err:  # the HF/megatron stack raises many types
        raise ConfigError(
            f"could not build GPT2BPETokenizer from --vocab-file {vocab_file} and "
            f"--merge-file {merge_file}: {type(err).__name__}: {err}"
        ) from None
    _check_gpt2_core(vocab_file, vocab[GPT2_EOD_TOKEN], eod, literal_eod_ok)
    # Embedding rows must cover every id in the file even if its ids have gaps.
    vocab_size = max(int(vocab_size), max(vocab.values()) + 1)
    return Tokenizer("GPT2BPETokenizer", core, vocab_size, eod, vocab_file, merge_file)


def _read_gpt2_inputs(vocab_file: Optional[str], merge_file: Optional[str]) -> dict:
    """The checked ``vocab.json`` (token -> id), once both files are readable and
    ``transformers`` is importable, in that order (a missing file is reported first)."""
    _check_readable_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
    _check_readable_file(merge_file, "--merge-file", "GPT2BPETokenizer")
    if not have_transformers():
        raise ConfigError(
            "--tokenizer-type GPT2BPETokenizer needs the 'transformers' package "
            "(megatron.core's 'huggingface' tokenizer library wraps it): "
            "`pip install transformers` (or install this project with its [bpe] extra), "
            "or use --tokenizer-type ByteLevelTokenizer"
        )
    return _read_gpt2_vocab(vocab_file)


def _gpt2_core_from_files(vocab_file: str, merge_file: str):
    """megatron.core's ``"huggingface"`` GPT-2 tokenizer built from the two local files.

    Why not megatron.core's ``"megatron"`` library (``MegatronHFTokenizer``): in
    megatron.core 0.16.1 it passes the vocab file as the merges file and then calls
    ``AutoTokenizer.from_pretrained("gpt2", ...)``, which needs the HuggingFace Hub.

    Why not ``"huggingface"`` with ``vocab_file=`` / ``merges_file=`` (its
    ``HuggingFaceTokenizer``): it forwards the merges path under the misspelt keyword
    ``merge_files``, which transformers ignores, and it still needs a
    ``tokenizer_path`` that AutoTokenizer can resolve. transformers 5.x then silently
    *generates* merges from the vocabulary when merges.txt is missing, and (5.23) it
    ignores vocab/merges paths written into a tokenizer_config.json: it only takes
    files inside the directory, or paths passed as keyword arguments, which
    megatron.core does not do for the merges file.

    So the two files are symlinked (copied where that fails), under the names GPT-2
    tokenizers look for (``vocab.json``, ``merges.txt``), into a fresh private
    temporary directory together with a minimal ``tokenizer_config.json``
    (:data:`_GPT2_TOKENIZER_CONFIG`), and that directory is the ``tokenizer_path``.
    AutoTokenizer resolves everything locally (no network), reads both files while
    constructing the tokenizer, and the directory is removed right after (also when
    the process is terminated meanwhile: :func:`_sigterm_cleans_up`). ``tempfile``
    gives every call its own directory, so ranks or preprocessing workers building
    concurrently never share a path.
    """
    core_class = core_tokenizer_class()
    # Import transformers (via megatron.core's wrapper) *before* creating the
    # directory, so that it exists only for the few milliseconds the tokenizer takes
    # to build.
    with quiet_core_import():
        import megatron.core.tokenizers.text.libraries  # noqa: F401
    with _sigterm_cleans_up(), tempfile.TemporaryDirectory(
        prefix="megatron-gpt2-bpe-"
    ) as tmp_dir:
        _link_or_copy(vocab_file, os.path.join(tmp_dir, "vocab.json"))
        _link_or_copy(merge_file, os.path.join(tmp_dir, "merges.txt"))
        with open(os.path.join(tmp_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(_GPT2_TOKENIZER_CONFIG, f)
        return core_class.from_pretrained(
            tokenizer_path=tmp_dir,
            metadata_path={"library": "huggingface", "model_type": "gpt"},
            # Rust BPE on transformers 4.x too (5.x has only that one).
            use_fast=True,
        )


def _check_gpt2_core(vocab_file: str, expected_eod: int, eod: int,
                     literal_eod_ok: bool) -> None:
    """Refuse a built GPT-2 tokenizer whose eod is not the file's ``<|endoftext|>`` id,
    or that turns a literal ``<|endoftext|>`` in the text into the eod id."""
    if eod != expected_eod:
        raise ConfigError(
            f"--vocab-file {vocab_file}: {GPT2_EOD_TOKEN!r} has id {expected_eod} in the "
            f"file but the tokenizer maps it to {eod}"
        )
    if not literal_eod_ok:
        raise ConfigError(
            "--tokenizer-type GPT2BPETokenizer: the installed transformers turns a literal "
            f"{GPT2_EOD_TOKEN!r} in the text into the end-of-document id; "
            "`pip install 'transformers>=4.43'`"
        )


def _build_null(vocab_size: Optional[int]) -> Tokenizer:
    if vocab_size is None:
        raise ConfigError("--vocab-size is required for --tokenizer-type NullTokenizer")
    vocab_size = check_int(vocab_size, "--vocab-size", minimum=1)
    core = core_tokenizer_class().from_pretrained(
        metadata_path={"library": "null"}, vocab_size=vocab_size
    )
    # The null library appends one eod id after the given vocabulary.
    return Tokenizer("NullTokenizer", core, core.vocab_size, core.eod)


def build_tokenizer(
    tokenizer_type: Optional[str] = DEFAULT_TOKENIZER_TYPE,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    *,
    vocab_size: Optional[int] = None,
) -> Tokenizer:
    """Build a :class:`Tokenizer`.

    Args:
        tokenizer_type: one of :data:`TOKENIZER_TYPES` (None -> ByteLevelTokenizer).
        vocab_file: GPT-2 ``vocab.json`` (``--vocab-file``), GPT2BPETokenizer only.
        merge_file: GPT-2 ``merges.txt`` (``--merge-file``), GPT2BPETokenizer only.
        vocab_size: NullTokenizer only: ids are ``0..vocab_size-1`` and eod is
            ``vocab_size`` (so the returned ``.vocab_size`` is ``vocab_size + 1``).

    Raises:
        ConfigError: unknown type, missing/unreadable vocab or merges file, or a missing
            optional dependency.
    """
    if tokenizer_type is None:
        tokenizer_type = DEFAULT_TOKENIZER_TYPE
    if tokenizer_type == "ByteLevelTokenizer":
        return _build_byte_level()
    if tokenizer_type == "GPT2BPETokenizer":
        return _build_gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        return _build_null(vocab_size)
    raise ConfigError(
        f"--tokenizer-type: unknown tokenizer {tokenizer_type!r}; "
        f"choose one of {', '.join(TOKENIZER_TYPES)}"
    )
