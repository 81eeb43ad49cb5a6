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
:meth:`Tokenizer.detokenize` decodes bytes itself for an exact round trip.
"""

import importlib.util
import os
from collections import OrderedDict
from typing import Iterable, List, Optional

from megatron.data._compat import check_int, quiet_core_import
from megatron.training.errors import ConfigError

TOKENIZER_TYPES = ("ByteLevelTokenizer", "GPT2BPETokenizer", "NullTokenizer")
DEFAULT_TOKENIZER_TYPE = "ByteLevelTokenizer"

NO_PAD_ID = -1
BYTE_LEVEL_EOD = 256
BYTE_LEVEL_VOCAB_SIZE = 257


class Tokenizer:
    """What the trainer and datasets need from a tokenizer.

    Attributes:
        tokenizer_type: one of :data:`TOKENIZER_TYPES`.
        core: the underlying ``megatron.core.tokenizers`` object.
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
    ) -> None:
        self.tokenizer_type = tokenizer_type
        self.core = core
        self._vocab_size = int(vocab_size)
        self._eod = int(eod)
        self.vocab_file = vocab_file
        self.merge_file = merge_file

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
        return self.core.detokenize([i for i in ids if i != self._eod])

    def __repr__(self) -> str:
        return (
            f"Tokenizer(type={self.tokenizer_type}, vocab_size={self._vocab_size}, "
            f"eod={self._eod})"
        )


def _core_tokenizer_class():
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
    core = _core_tokenizer_class().from_pretrained(
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
    return Tokenizer("ByteLevelTokenizer", core, BYTE_LEVEL_VOCAB_SIZE, BYTE_LEVEL_EOD)


def _build_gpt2_bpe(vocab_file: Optional[str], merge_file: Optional[str]) -> Tokenizer:
    _check_readable_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
    _check_readable_file(merge_file, "--merge-file", "GPT2BPETokenizer")
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "--tokenizer-type GPT2BPETokenizer needs the 'transformers' package "
            "(megatron.core's 'megatron' tokenizer library wraps HuggingFace): "
            "`pip install transformers`, or use --tokenizer-type ByteLevelTokenizer"
        )
    try:
        core = _core_tokenizer_class().from_pretrained(
            tokenizer_path="GPT2BPETokenizer",
            metadata_path={"library": "megatron", "model_type": "gpt"},
            vocab_file=vocab_file,
            merges_file=merge_file,
        )
        vocab_size, eod = core.vocab_size, core.eod
    except ConfigError:
        raise
    except Exception as err:  # the HF/megatron stack raises many types
        raise ConfigError(
            f"could not build GPT2BPETokenizer from --vocab-file {vocab_file} and "
            f"--merge-file {merge_file}: {type(err).__name__}: {err}"
        ) from None
    if eod is None:
        raise ConfigError(
            f"--vocab-file {vocab_file}: the GPT-2 vocabulary has no end-of-text token"
        )
    return Tokenizer("GPT2BPETokenizer", core, vocab_size, eod, vocab_file, merge_file)


def _build_null(vocab_size: Optional[int]) -> Tokenizer:
    if vocab_size is None:
        raise ConfigError("--vocab-size is required for --tokenizer-type NullTokenizer")
    vocab_size = check_int(vocab_size, "--vocab-size", minimum=1)
    core = _core_tokenizer_class().from_pretrained(
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
