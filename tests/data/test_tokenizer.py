import json
import os
import signal
import socket
import sys
import tempfile
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import megatron.data.tokenizer as tokenizer_module  # noqa: E402
from megatron.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from tests.launch import fresh_python  # noqa: E402

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


def test_byte_level_builds_its_library_tokenizer_on_first_use(monkeypatch):
    """A trainer needs only vocab_size and eod: building the tokenizer must not import
    megatron.core's tokenizers (they import HuggingFace transformers, about 2.5 s of CPU
    per rank); the first tokenize builds it, checked against the ids stated above."""
    code = ("import sys\n"
            "from megatron.data.tokenizer import build_tokenizer\n"
            "tok = build_tokenizer('ByteLevelTokenizer')\n"
            "print(tok.vocab_size, tok.eod, 'transformers' in sys.modules)\n"
            "print(tok.tokenize('ab'), tok.core.eod)\n")
    assert fresh_python(code)[-2:] == ["257 256 False", "[97, 98] 256"]

    class ShiftedIds:  # a megatron.core that placed <eod> elsewhere
        @staticmethod
        def from_pretrained(**kwargs):
            return type("Core", (), {"vocab_size": 258, "eod": 257, "_tokenizer": type(
                "Lib", (), {"token_to_id": staticmethod(lambda t: 257)})()})()

    monkeypatch.setattr(tokenizer_module, "core_tokenizer_class", lambda: ShiftedIds)
    tok = build_tokenizer("ByteLevelTokenizer")
    with pytest.raises(RuntimeError, match="assigned unexpected ids"):
        tok.tokenize("a")


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


def _tiny_bpe_files(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text('{"a": 0, "<|endoftext|>": 1}')
    merges.write_text("#version: 0.2\n")
    return str(vocab), str(merges)


def _assert_missing_transformers_error(info):
    message = str(info.value)
    assert "pip install transformers" in message
    assert "[bpe]" in message
    assert "ByteLevelTokenizer" in message


def test_gpt2_without_transformers(tmp_path, monkeypatch):
    # The real check (importlib.util.find_spec) reports a module mapped to None in
    # sys.modules as missing, whether or not transformers is installed here.
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert not tokenizer_module.have_transformers()
    with pytest.raises(ConfigError) as info:
        build_tokenizer("GPT2BPETokenizer", *_tiny_bpe_files(tmp_path))
    _assert_missing_transformers_error(info)


def test_gpt2_without_transformers_check_patched(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "have_transformers", lambda: False)
    with pytest.raises(ConfigError) as info:
        build_tokenizer("GPT2BPETokenizer", *_tiny_bpe_files(tmp_path))
    _assert_missing_transformers_error(info)


def test_gpt2_missing_files_reported_before_transformers(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "have_transformers", lambda: False)
    vocab, _ = _tiny_bpe_files(tmp_path)
    with pytest.raises(ConfigError, match="--merge-file: file not found"):
        build_tokenizer("GPT2BPETokenizer", vocab, str(tmp_path / "nope.txt"))


# ---------------------------------------------------------------------------
# A small but real GPT-2 byte-level BPE vocabulary, written the way GPT-2's
# vocab.json / merges.txt are: every byte is a printable "symbol" (printable
# Latin-1 bytes stand for themselves, the others are shifted to U+0100...), merges
# are pairs of symbols in priority order, and <|endoftext|> is the last id.

MERGES = [
    "Ġ t", "h e", "Ġt he",  # " the"
    "Ġ a", "n d", "Ġa nd",  # " and"
    "i n", "Ġ c", "a t",
]
UNMERGED = "xy"  # in the vocabulary, but no merge produces it
EOT = "<|endoftext|>"


def gpt2_byte_symbols():
    """byte -> symbol, and GPT-2's id order of the 256 base symbols."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    symbols = {b: chr(b) for b in printable}
    shifted = [b for b in range(256) if b not in symbols]
    for n, b in enumerate(shifted):
        symbols[b] = chr(256 + n)
    return symbols, printable + shifted


def gpt2_vocab():
    symbols, order = gpt2_byte_symbols()
    vocab = {symbols[b]: i for i, b in enumerate(order)}
    for merge in MERGES:
        vocab[merge.replace(" ", "")] = len(vocab)
    vocab[UNMERGED] = len(vocab)
    vocab[EOT] = len(vocab)
    return vocab


def write_gpt2_files(directory, vocab=None, merges=None):
    directory.mkdir(parents=True, exist_ok=True)
    vocab_path, merges_path = directory / "vocab.json", directory / "merges.txt"
    vocab_path.write_text(
        json.dumps(gpt2_vocab() if vocab is None else vocab, ensure_ascii=False),
        encoding="utf-8",
    )
    lines = MERGES if merges is None else merges
    merges_path.write_text("#version: 0.2\n" + "".join(m + "\n" for m in lines), encoding="utf-8")
    return str(vocab_path), str(merges_path)


def byte_ids(text):
    """Ids of ``text`` with no merges applied (one id per UTF-8 byte)."""
    symbols, _ = gpt2_byte_symbols()
    vocab = gpt2_vocab()
    return [vocab[symbols[b]] for b in text.encode("utf-8")]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return write_gpt2_files(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def gpt2_tok(gpt2_files):
    return build_tokenizer("GPT2BPETokenizer", *gpt2_files)


ENGLISH = [
    "the cat and the hat",
    " the",
    "In the beginning the Universe was created.\nThis has made a lot of people very angry"
    " and been widely regarded as a bad move.\n\n  Indented line\twith a tab, the end.  \n",
    "Caf\u00e9 au lait and the cr\u00e8me br\u00fbl\u00e9e",
]


@pytest.mark.parametrize("text", ENGLISH + TEXTS)
def test_gpt2_round_trip(gpt2_tok, text):
    ids = gpt2_tok.tokenize(text)
    assert all(isinstance(i, int) for i in ids)
    assert all(0 <= i < gpt2_tok.vocab_size for i in ids)
    assert gpt2_tok.eod not in ids
    assert gpt2_tok.detokenize(ids) == text
    # eod tokens are dropped when decoding
    assert gpt2_tok.detokenize(ids + [gpt2_tok.eod]) == text


def test_gpt2_ids_and_eod(gpt2_tok, gpt2_files):
    vocab = gpt2_vocab()
    assert gpt2_tok.vocab_size == len(vocab) == 256 + len(MERGES) + 2
    assert gpt2_tok.eod == vocab[EOT] == len(vocab) - 1
    assert gpt2_tok.eos == gpt2_tok.eod
    assert gpt2_tok.core.eod == gpt2_tok.eod  # the megatron.core object agrees
    assert gpt2_tok.pad == -1
    assert gpt2_tok.tokenizer_type == "GPT2BPETokenizer"
    assert (gpt2_tok.vocab_file, gpt2_tok.merge_file) == gpt2_files
    # the base symbols have GPT-2's real ids: "!" is 0 and a space ("\u0120") is 220
    assert gpt2_tok.tokenize("!") == [0]
    assert gpt2_tok.tokenize(" ") == [vocab["\u0120"]] == [220]


def test_gpt2_merges_are_applied(gpt2_tok):
    vocab = gpt2_vocab()
    assert gpt2_tok.tokenize(" the") == [vocab["\u0120the"]]
    assert gpt2_tok.tokenize("the") == [vocab["t"], vocab["he"]]
    assert gpt2_tok.tokenize("the cat and the hat") == [
        vocab["t"], vocab["he"], vocab["\u0120c"], vocab["at"], vocab["\u0120and"],
        vocab["\u0120the"], vocab["\u0120"], vocab["h"], vocab["at"],
    ]
    # Only merges.txt decides: "xy" is in the vocabulary but no merge makes it (a
    # tokenizer that ignored merges.txt and derived merges from vocab.json would).
    assert gpt2_tok.tokenize(UNMERGED) == [vocab["x"], vocab["y"]]
    # non-ASCII characters fall back to their UTF-8 bytes
    assert gpt2_tok.tokenize("\u00e9") == byte_ids("\u00e9") and len(byte_ids("\u00e9")) == 2


def test_gpt2_literal_endoftext_is_text(gpt2_tok):
    text = "one document<|endoftext|>not a boundary"
    ids = gpt2_tok.tokenize(text)
    assert gpt2_tok.eod not in ids
    assert gpt2_tok.detokenize(ids) == text


def test_gpt2_detokenize_rejects_out_of_range(gpt2_tok):
    with pytest.raises(ValueError, match=str(gpt2_tok.vocab_size)):
        gpt2_tok.detokenize([0, gpt2_tok.vocab_size])
    with pytest.raises(ValueError, match="-1"):
        gpt2_tok.detokenize([-1])


def test_gpt2_unique_identifiers(gpt2_tok, gpt2_files):
    ids = json.loads(json.dumps(gpt2_tok.unique_identifiers))
    assert ids["tokenizer_type"] == "GPT2BPETokenizer"
    assert ids["vocab_size"] == gpt2_tok.vocab_size
    assert ids["eod"] == gpt2_tok.eod
    assert ids["vocab_file"] == os.path.abspath(gpt2_files[0])
    assert ids["merge_file"] == os.path.abspath(gpt2_files[1])
    again = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    assert json.dumps(again.unique_identifiers) == json.dumps(gpt2_tok.unique_identifiers)


def test_gpt2_offline_and_cleans_up(gpt2_files, tmp_path, monkeypatch):
    """No network, and the private temporary directory is removed again."""

    def no_network(*args, **kwargs):
        raise AssertionError("GPT2BPETokenizer tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    tok = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    assert tok.detokenize(tok.tokenize(ENGLISH[2])) == ENGLISH[2]
    assert os.listdir(scratch) == []


def test_gpt2_sigterm_while_building_cleans_up(gpt2_files, tmp_path, monkeypatch):
    """A process terminated while building removes its temporary directory, then dies
    of SIGTERM (os.kill is faked here so that pytest survives)."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen = {}

    class TerminatedWhileBuilding:
        @staticmethod
        def from_pretrained(tokenizer_path=None, **kwargs):
            seen["files"] = sorted(os.listdir(tokenizer_path))
            # (without a handler the signal would kill pytest itself)
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
            signal.raise_signal(signal.SIGTERM)
            raise AssertionError("SIGTERM did not interrupt the build")

    kills = []
    monkeypatch.setattr(tokenizer_module, "core_tokenizer_class", lambda: TerminatedWhileBuilding)
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    with pytest.raises(tokenizer_module.Terminated):
        build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    assert seen["files"] == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    assert os.listdir(scratch) == []
    assert kills == [(os.getpid(), signal.SIGTERM)]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_gpt2_without_symlinks_copies(gpt2_files, tmp_path, monkeypatch):
    def no_symlink(*args, **kwargs):
        raise OSError("symlinks not supported here")

    monkeypatch.setattr(os, "symlink", no_symlink)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    tok = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    assert tok.tokenize(" the") == [gpt2_vocab()["\u0120the"]]
    assert os.listdir(scratch) == []


def test_gpt2_clean_up_keeps_the_input_files(gpt2_files):
    before = [open(path, "rb").read() for path in gpt2_files]
    build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    assert [open(path, "rb").read() for path in gpt2_files] == before


def test_gpt2_files_with_other_names(tmp_path):
    # the flags take any file names, not only vocab.json / merges.txt
    vocab, merges = write_gpt2_files(tmp_path / "src")
    os.rename(vocab, tmp_path / "gpt2-vocab.json")
    os.rename(merges, tmp_path / "gpt2-merges.txt")
    tok = build_tokenizer(
        "GPT2BPETokenizer", str(tmp_path / "gpt2-vocab.json"), str(tmp_path / "gpt2-merges.txt")
    )
    assert tok.tokenize(" the") == [gpt2_vocab()["\u0120the"]]


def test_gpt2_concurrent_builds(gpt2_files):
    results, errors = [], []

    def build():
        try:
            tok = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
            results.append(tok.tokenize(ENGLISH[0]))
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(results) == 4 and all(r == results[0] for r in results)


def test_gpt2_vocab_without_endoftext(tmp_path):
    vocab = gpt2_vocab()
    del vocab[EOT]
    files = write_gpt2_files(tmp_path, vocab=vocab)
    with pytest.raises(ConfigError) as info:
        build_tokenizer("GPT2BPETokenizer", *files)
    assert "--vocab-file" in str(info.value)
    assert files[0] in str(info.value)
    assert EOT in str(info.value)


@pytest.mark.parametrize(
    "content", ["not json", "[1, 2]", "{}", '{"a": "zero", "<|endoftext|>": 1}']
)
def test_gpt2_bad_vocab_file(tmp_path, content):
    vocab, merges = write_gpt2_files(tmp_path)
    with open(vocab, "w") as f:
        f.write(content)
    with pytest.raises(ConfigError) as info:
        build_tokenizer("GPT2BPETokenizer", vocab, merges)
    assert "--vocab-file" in str(info.value)
    assert vocab in str(info.value)


def test_gpt2_bad_merges_file(tmp_path):
    files = write_gpt2_files(tmp_path, merges=["q z", "qz notinvocab"])
    with pytest.raises(ConfigError) as info:
        build_tokenizer("GPT2BPETokenizer", *files)
    message = str(info.value)
    assert "could not build GPT2BPETokenizer" in message
    assert files[1] in message


def _read_dataset(prefix):
    from megatron.data.compat import quiet_core_import

    with quiet_core_import():
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return dataset, [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt2_preprocess_round_trip(gpt2_tok, gpt2_files, tmp_path, workers):
    from megatron.data.preprocess import preprocess

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ENGLISH[2:] + [TEXTS[1], TEXTS[2], "the end <|endoftext|> of the text"]
    for n, text in enumerate(texts):
        (corpus / f"doc{n}.txt").write_bytes(text.encode("utf-8"))
    summary = preprocess(
        [str(corpus)],
        str(tmp_path / "out" / "bpe"),
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=gpt2_files[0],
        merge_file=gpt2_files[1],
        append_eod=True,
        workers=workers,
        log=lambda m: None,
    )
    assert summary["documents"] == {"text": len(texts)}
    dataset, docs = _read_dataset(summary["outputs"]["text"])
    assert dataset.index.dtype.__name__ == "uint16"
    assert len(docs) == len(texts)
    for doc, text in zip(docs, texts):  # files are read in sorted order: doc0, doc1, ...
        assert doc[-1] == gpt2_tok.eod
        assert gpt2_tok.eod not in doc[:-1]
        assert doc[:-1] == gpt2_tok.tokenize(text)
        assert gpt2_tok.detokenize(doc) == text
    assert summary["tokens"] == {"text": sum(len(d) for d in docs)}
    # merges were applied: fewer tokens than UTF-8 bytes
    assert sum(len(d) - 1 for d in docs) < sum(len(t.encode("utf-8")) for t in texts)


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 101
    assert tok.eod == 100
    assert tok.tokenize("5 7 99") == [5, 7, 99]
    assert tok.detokenize([5, 7, 100]) == "5 7"
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
