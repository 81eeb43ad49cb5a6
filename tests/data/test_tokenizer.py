import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron.training.errors import ConfigError  # noqa: E402

TEXTS = [
    "Hello, world!",
    "Grüße aus Köln — naïve café, 東京, Ελληνικά, emoji 🙂🚀",
    "trailing whitespace and newlines stay  \n\n",
    "windows\r\nline endings\r\n",
    "",
    "\x00 nul and \t tabs",
]


@pytest.fixture(scope="module")
def byte_tok():
    return build_tokenizer("ByteLevelTokenizer")


def test_types_tuple():
    assert TOKENIZER_TYPES == ("ByteLevelTokenizer", "GPT2BPETokenizer", "NullTokenizer")


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(byte_tok, text):
    ids = byte_tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert byte_tok.detokenize(ids) == text
    # eod tokens are dropped when decoding
    assert byte_tok.detokenize(ids + [byte_tok.eod]) == text


def test_byte_level_ids(byte_tok):
    assert byte_tok.vocab_size == 257
    assert byte_tok.eod == 256
    assert byte_tok.core.eod == 256  # the megatron.core object agrees
    assert byte_tok.tokenize("é") == [0xC3, 0xA9]
    every_byte = byte_tok.tokenize("".join(chr(c) for c in range(256)))
    assert set(every_byte) <= set(range(256))
    assert byte_tok.eod not in every_byte
    assert byte_tok.eod not in byte_tok.tokenize(TEXTS[1])
    assert byte_tok.pad == -1


def test_byte_level_default_type():
    assert build_tokenizer().eod == 256
    assert build_tokenizer(None).vocab_size == 257


def test_detokenize_rejects_out_of_range(byte_tok):
    with pytest.raises(ValueError, match="257"):
        byte_tok.detokenize([65, 257])


def test_unique_identifiers_are_json_and_stable(byte_tok):
    first = json.dumps(byte_tok.unique_identifiers)
    assert first == json.dumps(build_tokenizer("ByteLevelTokenizer").unique_identifiers)
    assert '"eod": 256' in first


def test_unknown_type():
    with pytest.raises(ConfigError) as info:
        build_tokenizer("SentencePieceTokenizer")
    message = str(info.value)
    assert "--tokenizer-type" in message
    assert "SentencePieceTokenizer" in message
    for name in TOKENIZER_TYPES:
        assert name in message


def test_gpt2_needs_vocab_flag():
    with pytest.raises(ConfigError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer")


def test_gpt2_missing_vocab_file(tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    missing = tmp_path / "nope" / "vocab.json"
    with pytest.raises(ConfigError) as info:
        build_tokenizer("GPT2BPETokenizer", str(missing), str(merges))
    assert "--vocab-file" in str(info.value)
    assert str(missing) in str(info.value)


def test_gpt2_missing_merge_file(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    with pytest.raises(ConfigError) as info:
        build_tokenizer("GPT2BPETokenizer", str(vocab), str(tmp_path / "merges.txt"))
    assert "--merge-file" in str(info.value)
    assert str(tmp_path / "merges.txt") in str(info.value)


def test_gpt2_directory_as_vocab_file(tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    with pytest.raises(ConfigError, match="--vocab-file: not a regular file"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path), str(merges))


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is not None, reason="transformers is installed"
)
def test_gpt2_without_transformers(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text('{"a": 0}')
    merges.write_text("#version: 0.2\n")
    with pytest.raises(ConfigError) as info:
        build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
    assert "pip install transformers" in str(info.value)
    assert "ByteLevelTokenizer" in str(info.value)


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 101
    assert tok.eod == 100
    assert tok.tokenize("5 7 99") == [5, 7, 99]
    assert tok.detokenize([5, 7, 100]) == "5 7"
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
