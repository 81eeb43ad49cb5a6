"""Megatron-DeepSpeed's separate datasets: --train-data-path, --valid-data-path and
--test-data-path, each used whole instead of --data-path carved by --split."""

import pytest

from megatron.data import build_tokenizer, build_train_valid_test_datasets
from megatron.errors import ConfigError
from tests.data.test_gpt_dataset import make_args, make_corpus


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two preprocessed byte-level corpora (12 and 5 documents): their dataset prefixes."""
    from megatron.data import preprocess as tool
    root = tmp_path_factory.mktemp("separate")
    prefixes = []
    for name, count in (("train", 12), ("valid", 5)):
        make_corpus(root / f"{name}_txt", count)
        prefixes.append(tool.preprocess([str(root / f"{name}_txt")], str(root / name),
                                        append_eod=True, log=lambda m: None)["outputs"]["text"])
    return prefixes


def _separate(tmp_path, train, valid=None, test=None, **overrides):
    return make_args(None, tmp_path, split=None, train_data_path=train, valid_data_path=valid,
                     test_data_path=test, **overrides)


def test_each_dataset_is_used_whole(corpora, tmp_path):
    train_prefix, valid_prefix = corpora
    args = _separate(tmp_path, [train_prefix], [valid_prefix])
    tok = build_tokenizer("ByteLevelTokenizer")
    train, valid, test = build_train_valid_test_datasets(args, tok)
    assert test is None  # no --test-data-path
    assert train.dataset.path_prefix == train_prefix and valid.dataset.path_prefix == valid_prefix
    # every document of each file, not a --split share of it
    assert set(train.document_index.tolist()) == set(range(12))
    assert set(valid.document_index.tolist()) == set(range(5))
    assert len(train) >= 10 * 4 and len(valid) >= (10 // 5 + 1) * 2 * 4


def test_a_weighted_blend_per_split(corpora, tmp_path):
    train_prefix, valid_prefix = corpora
    args = _separate(tmp_path, ["0.7", train_prefix, "0.3", valid_prefix], [valid_prefix],
                     eval_iters=0)
    train, valid, _ = build_train_valid_test_datasets(args, build_tokenizer("ByteLevelTokenizer"))
    assert valid is None  # --eval-iters 0: nobody draws from it
    assert sorted(d.dataset.path_prefix for d in train.datasets) == sorted(corpora)
    assert len(train) == 10 * 4


@pytest.mark.parametrize("paths, needle", [
    (dict(valid=["nope/valid"]), "--valid-data-path: missing file nope/valid.bin"),
    (dict(test=["0", "nope/test"]), "--test-data-path: weight '0'"),
])
def test_errors_name_the_flag_of_the_split(corpora, tmp_path, paths, needle):
    args = _separate(tmp_path, [corpora[0]], **paths)
    with pytest.raises(ConfigError, match=needle):
        build_train_valid_test_datasets(args, build_tokenizer("ByteLevelTokenizer"))
