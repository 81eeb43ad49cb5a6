import json
import math
import os
import shutil
import socket
import subprocess
import sys
import types

import numpy
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron.data import (  # noqa: E402
    build_pretraining_data_loader,
    build_tokenizer,
    build_train_valid_test_datasets,
)
from megatron.data.gpt_dataset import get_split_sizes, parse_data_path, parse_split  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def make_corpus(directory, count):
    directory.mkdir(parents=True)
    for i in range(count):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + (i * 11) % 40)]
        (directory / f"doc{i:03d}.txt").write_text(f"[{i}] " + " ".join(words) + ".\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A preprocessed 40-document byte-level corpus; returns its dataset prefix."""
    root = tmp_path_factory.mktemp("gpt")
    make_corpus(root / "txt", 40)
    from megatron.data import preprocess as tool
    summary = tool.preprocess([str(root / "txt")], str(root / "corpus"), append_eod=True,
                              log=lambda m: None)
    return summary["outputs"]["text"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("ByteLevelTokenizer")


def make_args(data_path, tmp_path, **overrides):
    args = dict(
        data_path=data_path, split="80,15,5", seq_length=32, seed=1234, micro_batch_size=2,
        global_batch_size=4, train_iters=10, eval_interval=5, eval_iters=2,
        data_cache_path=str(tmp_path / "cache"),
    )
    args.update(overrides)
    return types.SimpleNamespace(**args)


def document_stream(dataset):
    """All tokens of the dataset's documents in its (shuffled) document order."""
    low = dataset.dataset
    return numpy.concatenate([low.get(int(d)) for d in dataset.document_index]).astype(numpy.int64)


def contains(stream, window):
    window = numpy.asarray(window, dtype=numpy.int64)
    views = numpy.lib.stride_tricks.sliding_window_view(stream, len(window))
    return bool((views == window).all(axis=1).any())


def test_single_prefix_samples(corpus, tok, tmp_path):
    train, valid, test = build_train_valid_test_datasets(make_args([corpus], tmp_path), tok)
    sizes = [10 * 4, (10 // 5 + 1) * 2 * 4, 2 * 4]
    assert [len(train) >= sizes[0], len(valid) >= sizes[1], len(test) >= sizes[2]] == [True] * 3
    stream = document_stream(train)
    for index in (0, 1, len(train) - 1):
        sample = train[index]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        for key in ("tokens", "labels", "position_ids"):
            assert sample[key].dtype == torch.int64 and sample[key].shape == (32,)
        assert sample["loss_mask"].dtype == torch.float32
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert torch.equal(sample["position_ids"], torch.arange(32))
        assert torch.equal(sample["loss_mask"], torch.ones(32))
        window = sample["tokens"].tolist() + [int(sample["labels"][-1])]
        assert contains(stream, window), "sample is not a contiguous window of the documents"
    # the train split only uses the first 80% of the documents (0..31)
    assert set(train.document_index.tolist()) == set(range(32))
    assert set(valid.document_index.tolist()) == set(range(32, 38))
    assert set(test.document_index.tolist()) == set(range(38, 40))
    assert any(tok.eod in train[i]["tokens"].tolist() for i in range(5))


def test_cache_reuse_is_deterministic(corpus, tok, tmp_path):
    first, _, _ = build_train_valid_test_datasets(make_args([corpus], tmp_path), tok)
    files = sorted(os.listdir(tmp_path / "cache"))
    assert any(name.endswith("train-shuffle_index.npy") for name in files)
    second, _, _ = build_train_valid_test_datasets(make_args([corpus], tmp_path), tok)
    assert sorted(os.listdir(tmp_path / "cache")) == files
    for i in range(len(first)):
        assert torch.equal(first[i]["tokens"], second[i]["tokens"])


def test_truncated_cache_file_is_rebuilt(corpus, tok, tmp_path):
    reference, _, _ = build_train_valid_test_datasets(make_args([corpus], tmp_path), tok)
    cache = tmp_path / "cache"
    victim = next(p for p in cache.iterdir() if p.name.endswith("train-sample_index.npy"))
    victim.write_bytes(victim.read_bytes()[:-8])
    again, _, _ = build_train_valid_test_datasets(make_args([corpus], tmp_path), tok)
    assert victim.stat().st_size > 0
    assert numpy.load(victim).shape == reference.sample_index.shape
    assert torch.equal(again[3]["tokens"], reference[3]["tokens"])


def test_default_cache_next_to_data(corpus, tok, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(corpus + ext, data_dir / ("c" + ext))
    args = make_args([str(data_dir / "c")], tmp_path, data_cache_path=None)
    build_train_valid_test_datasets(args, tok)
    assert (data_dir / "cache").is_dir()
    assert any(p.name.endswith(".npy") for p in (data_dir / "cache").iterdir())


def test_blend_single_process_and_loader(corpus, tok, tmp_path):
    args = make_args(["0.3", corpus, "0.7", corpus], tmp_path)
    train, valid, test = build_train_valid_test_datasets(args, tok)
    # megatron.core rounds each source's share up: sum(ceil(size * weight))
    expected = [math.ceil(n * 0.3) + math.ceil(n * 0.7) for n in (40, 24, 8)]
    assert expected == [40, 25, 9]
    assert [len(train), len(valid), len(test)] == expected
    ids = [int(train[i]["dataset_id"]) for i in range(len(train))]
    assert ids.count(0) == 12 and ids.count(1) == 28
    loader = build_pretraining_data_loader(train, 0, 2, 0, 2)
    batch = next(iter(loader))
    assert batch["tokens"].shape == (2, 32) and batch["tokens"].dtype == torch.int64
    assert torch.equal(batch["tokens"][1], train[1]["tokens"])


def test_eval_iters_zero_builds_no_eval_sets(tiny_corpus, tok, tmp_path):
    # with 3 documents the valid/test ranges of "98,1,1" are empty; eval_iters=0 means
    # they are not needed, so they are not built (megatron.core would loop forever)
    args = make_args([tiny_corpus], tmp_path, eval_iters=0, split="98,1,1")
    train, valid, test = build_train_valid_test_datasets(args, tok)
    assert valid is None and test is None and len(train) >= 40


def test_split_weight_zero_gives_none(corpus, tok, tmp_path):
    train, valid, test = build_train_valid_test_datasets(
        make_args([corpus], tmp_path, split="9,1,0"), tok
    )
    assert train is not None and valid is not None and test is None


def test_missing_bin(corpus, tok, tmp_path):
    prefix = tmp_path / "partial"
    shutil.copy(corpus + ".idx", str(prefix) + ".idx")
    with pytest.raises(ConfigError) as info:
        build_train_valid_test_datasets(make_args([str(prefix)], tmp_path), tok)
    assert "--data-path" in str(info.value)
    assert str(prefix) + ".bin" in str(info.value)


def test_missing_prefix_hint(corpus, tok, tmp_path):
    with pytest.raises(ConfigError, match=r"without the extension"):
        build_train_valid_test_datasets(make_args([corpus + ".bin"], tmp_path), tok)


def test_truncated_bin(corpus, tok, tmp_path):
    prefix = str(tmp_path / "trunc")
    shutil.copy(corpus + ".idx", prefix + ".idx")
    with open(corpus + ".bin", "rb") as f:
        data = f.read()
    with open(prefix + ".bin", "wb") as f:
        f.write(data[:-10])
    with pytest.raises(ConfigError, match="different or interrupted"):
        build_train_valid_test_datasets(make_args([prefix], tmp_path), tok)


def test_upstream_idx_without_eod_sizes_is_read_as_it_describes(tok, tmp_path, caplog):
    """Megatron-DeepSpeed's preprocess_data.py --append-eod leaves each document's eod out
    of the .idx's sizes (the fixture of tests/fixtures/megatron_deepspeed_moe): read as
    upstream reads it, with a warning; one more token than that is still refused."""
    fixture = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "fixtures", "megatron_deepspeed_moe", "data", "bytes_text_document")
    prefix = str(tmp_path / "upstream")
    for ext in (".bin", ".idx"):
        shutil.copy(fixture + ext, prefix + ext)
    with caplog.at_level("WARNING", logger="megatron.data.gpt_dataset"):
        train, _, _ = build_train_valid_test_datasets(
            make_args([prefix], tmp_path, split="98,2,0", seq_length=64), tok)
    assert "--append-eod records sizes without the eod" in caplog.text
    assert len(train) > 0
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ConfigError, match="different or interrupted"):
        build_train_valid_test_datasets(make_args([prefix], tmp_path, split="98,2,0"), tok)


def test_tokenizer_mismatch(corpus, tmp_path):
    small = build_tokenizer("NullTokenizer", vocab_size=100)
    with pytest.raises(ConfigError, match=r"token id 256"):
        build_train_valid_test_datasets(make_args([corpus], tmp_path), small)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    make_corpus(root / "few", 3)
    from megatron.data import preprocess as tool
    return tool.preprocess([str(root / "few")], str(root / "fewds"), append_eod=True,
                           log=lambda m: None)["outputs"]["text"]


def test_empty_split_is_config_error(tiny_corpus, tok, tmp_path):
    # 3 documents: valid gets round(0.98*3)=3 .. round(0.99*3)=3 -> nothing
    with pytest.raises(ConfigError, match=r"--split: the valid split"):
        build_train_valid_test_datasets(make_args([tiny_corpus], tmp_path, split="98,1,1"), tok)


def test_bad_flags(corpus, tok, tmp_path):
    with pytest.raises(ConfigError, match="--global-batch-size"):
        build_train_valid_test_datasets(make_args([corpus], tmp_path, global_batch_size=5), tok)
    with pytest.raises(ConfigError, match="--seq-length"):
        build_train_valid_test_datasets(make_args([corpus], tmp_path, seq_length=0), tok)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--data-cache-path"):
        build_train_valid_test_datasets(
            make_args([corpus], tmp_path, data_cache_path=str(blocker / "sub")), tok
        )


def test_parse_data_path():
    assert parse_data_path(["a/b"]) == (["a/b"], None)
    assert parse_data_path("a/b") == (["a/b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    assert parse_data_path(["a", "b", "c"]) == (["a", "b", "c"], None)
    assert parse_data_path(["2", "a"]) == (["a"], None)
    for bad, match in [
        (None, "--data-path is required"),
        ([], "--data-path"),
        (["0.3", "a", "b"], "WEIGHT PREFIX"),
        (["1", "a", "-1", "b"], "positive"),
        (["0", "a", "1", "b"], "positive"),
        (["nan", "a", "1", "b"], "positive"),
        (["a", "1", "b", "2"], "WEIGHT PREFIX"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_data_path(bad)


def test_parse_split():
    assert parse_split("969,30,1") == ("969,30,1", [0.969, 0.03, 0.001])
    assert parse_split("98/2")[0] == "98,2,0"
    assert parse_split("1")[1] == [1.0, 0.0, 0.0]
    for bad in ("", "a,b,c", "1,2,3,4", "0,0,0", "-1,2,3", "1e3,1,1"):
        with pytest.raises(ConfigError, match="--split"):
            parse_split(bad)


def test_split_sizes():
    args = types.SimpleNamespace(train_iters=100, global_batch_size=8, micro_batch_size=2,
                                 eval_interval=30, eval_iters=5)
    assert get_split_sizes(args) == [800, (100 // 30 + 1) * 5 * 8, 40]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_gloo(corpus, tok, tmp_path):
    """Rank 0 builds the caches while rank 1 waits; bad data fails on both ranks, no hang."""
    port = _free_port()
    cache = tmp_path / "shared_cache"
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(rank), "2", str(port), corpus, str(cache),
             str(tmp_path / f"rank{rank}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=90)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    assert results[0]["single"] == results[1]["single"]
    assert results[0]["blend"] == results[1]["blend"]
    assert results[0]["after"] == results[1]["after"] == results[0]["single"]["train"][:2]
    # all ranks missing the file: both name it; only rank 1 missing it: rank 0 is told too
    assert all("_missing.bin" in r["errors"][0] for r in results)
    assert "_missing.bin" in results[1]["errors"][1]
    assert "another rank" in results[0]["errors"][1]

    # same samples as a single-process build of the same configuration
    args = types.SimpleNamespace(
        data_path=[corpus], split="80,15,5", seq_length=16, seed=7, micro_batch_size=2,
        global_batch_size=4, train_iters=6, eval_interval=3, eval_iters=1,
        data_cache_path=str(tmp_path / "solo_cache"),
    )
    train, _, _ = build_train_valid_test_datasets(args, tok)
    assert results[0]["single"]["train"] == [train[i]["tokens"].tolist() for i in range(6)]
