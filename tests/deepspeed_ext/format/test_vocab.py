"""A padded vocabulary loaded under another padding (deepspeed_ext.format.vocab): the plan,
the rows the reader gives under any tensor-parallel split, and ``moc-ckpt consolidate
--padded-vocab-size``. No processes."""

import os

import pytest
import torch
from safetensors import safe_open

from deepspeed_ext import cli
from deepspeed_ext.format import manifest as mf
from deepspeed_ext.format.objects import OBJECTS_FILE, encode, write_objects_file
from deepspeed_ext.format.splits import TensorSplit
from deepspeed_ext.format.vocab import (OBJECTS_KEY, PaddedVocab, RowPlan, VocabMismatch,
                                        fit_rows, plan_rows)
from deepspeed_ext.store.reader import CheckpointReader, vocab_plan
from tests.deepspeed_ext.format.test_splits import save_split_checkpoint

EMBED = ("embed.weight", "head.weight")


def test_a_record_round_trips_and_a_malformed_one_is_refused():
    vocab = PaddedVocab(EMBED, 272, 257)
    assert PaddedVocab.from_record(vocab.to_record()) == vocab
    assert PaddedVocab.from_record(None) is None
    for record in ({"names": "embed.weight", "rows": 272, "real_rows": 257},
                   {"names": ["embed.weight"], "rows": 272},
                   {"names": ["embed.weight"], "rows": 256, "real_rows": 257},
                   {"names": [], "rows": 272, "real_rows": 257},
                   {"names": ["embed.weight"], "rows": 272.0, "real_rows": 257}, [272, 257]):
        with pytest.raises(ValueError):
            PaddedVocab.from_record(record)


def test_the_plan_trims_or_adds_padding_rows_only():
    at_t1, at_t2 = PaddedVocab(EMBED, 264, 257), PaddedVocab(EMBED, 272, 257)
    both = {name: 272 for name in EMBED}
    # nothing to fit: the same padding, or a model that describes no vocabulary
    assert plan_rows(at_t2, at_t2, both) is None
    assert plan_rows(None, at_t2, {"embed.weight": 272}) is None
    trim = plan_rows(at_t1, at_t2, both)
    assert trim == RowPlan(EMBED, 272, 264, 257)
    assert (trim.trimmed, trim.added, trim.saved_shape((264, 32))) == (8, 0, (272, 32))
    assert trim.describe().startswith("vocabulary padding 272 -> 264 rows: trimmed 8 padding "
                                      "rows of embed.weight, head.weight")
    # a tied output layer is one tensor: only the names the checkpoint holds are fitted
    grow = plan_rows(at_t2, at_t1, {"embed.weight": 264})
    assert grow == RowPlan(("embed.weight",), 264, 272, 257)
    assert (grow.trimmed, grow.added) == (0, 8)
    assert "added 8 zero padding rows of embed.weight" in grow.describe()


@pytest.mark.parametrize("saved, saved_rows, needle", [
    # another tokenizer: its rows are other tokens, whatever the padding
    (PaddedVocab(EMBED, 50304, 50257), 50304,
     "vocabulary has 50257 tokens \\(50304 rows with padding\\), this model's has 257 "
     "\\(264 rows\\): only padding rows"),
    (PaddedVocab(EMBED, 272, 260), 272, "has 260 tokens"),
    # saved without a record: its padding rows cannot be told from its tokens
    (None, 272, "records no vocabulary size .* loads only into 272 rows \\(this model has 264\\)"),
    (PaddedVocab(EMBED, 288, 257), 272, "records 288 vocabulary rows and holds 272"),
])
def test_the_plan_refuses_what_is_not_padding(saved, saved_rows, needle):
    with pytest.raises(VocabMismatch, match=needle):
        plan_rows(PaddedVocab(EMBED, 264, 257), saved, {name: saved_rows for name in EMBED})


def test_the_plan_refuses_vocabulary_tensors_that_disagree():
    with pytest.raises(VocabMismatch, match="different row counts"):
        plan_rows(PaddedVocab(EMBED, 264, 257), PaddedVocab(EMBED, 272, 257),
                  {"embed.weight": 272, "head.weight": 280})


def test_fit_rows_keeps_the_first_rows_and_adds_zero_rows():
    full = torch.randn(10, 3)
    assert torch.equal(fit_rows(full, 7), full[:7])
    grown = fit_rows(full, 12)
    assert torch.equal(grown[:10], full) and torch.equal(grown[10:], torch.zeros(2, 3))
    assert fit_rows(full, 10) is not full and torch.equal(fit_rows(full, 10), full)
    kept = fit_rows(full, 7)
    kept.fill_(0)  # a new tensor: the caller's is left alone
    assert full.abs().sum() > 0


def _fitted(full, rows):
    """``full`` with ``rows`` rows, spelled out: its first rows, then zeros."""
    if rows <= full.shape[0]:
        return full[:rows]
    return torch.cat([full, torch.zeros(rows - full.shape[0], full.shape[1])])


def _vocab_checkpoint(save_dir, rows=20, real_rows=17, record=True, dim=0):
    """Tensor ``w`` (``rows`` x 4) saved by 2 ranks splitting dimension ``dim`` (0: the
    vocabulary, as a vocabulary-parallel embedding), with the padded vocabulary record in
    its objects (or none)."""
    full = torch.randn(rows, 4)
    manifest = save_split_checkpoint(save_dir, full, TensorSplit((rows, 4), dim, 2))
    tag_dir = os.path.join(str(save_dir), manifest.tag)
    tree, _ = encode({OBJECTS_KEY: PaddedVocab(("w",), rows, real_rows).to_record()
                      if record else None})
    manifest.files[OBJECTS_FILE] = mf.FileEntry.from_record(
        write_objects_file(tag_dir, tree, None), rank=0)
    mf.write_manifest(tag_dir, manifest)
    return full


@pytest.mark.parametrize("rows, parts, dim", [(16, 1, 0), (16, 2, 0), (24, 2, 0), (24, 4, 0),
                                             (20, 4, 0), (16, 2, 1), (24, 4, 1)])
def test_the_reader_gives_each_rank_its_part_of_the_fitted_tensor(tmp_path, rows, parts, dim):
    """Saved by 2 ranks with 20 rows, read as ``parts`` ranks of a model with ``rows``:
    every part is the fitted tensor's (the token rows bit for bit, new rows zeros). A
    split of the vocabulary (dim 0) stores rows in order; one of the other dimension
    (dim 1) needs the re-ordering around the fitting."""
    full = _vocab_checkpoint(tmp_path, real_rows=15, dim=dim)
    want = _fitted(full, rows)
    target = TensorSplit((rows, 4), dim, parts)
    with CheckpointReader(str(tmp_path)) as reader:
        plan = vocab_plan(reader, PaddedVocab(("w",), rows, 15),
                          reader.objects()[OBJECTS_KEY])
        assert (plan is None) == (rows == 20)
        for p in range(parts):
            got = reader.read("w", "fp32", target.stored_offset(p, 0), target.part_numel,
                              split=target, rows=rows)
            assert torch.equal(got, want.chunk(parts, dim)[p].reshape(-1)), (rows, parts, p)
        assert torch.equal(reader.read_full("w", "fp32", rows=rows), want)
        with pytest.raises(IndexError):
            reader.read("w", "fp32", 0, rows * 4 + 1, rows=rows)


def test_consolidate_writes_the_vocabulary_with_the_rows_asked_for(tmp_path, capsys):
    full = _vocab_checkpoint(tmp_path / "ckpt")
    out = str(tmp_path / "model.safetensors")
    for rows, line in ((24, "vocabulary padding 20 -> 24 rows: added 4 zero padding rows"),
                       (17, "vocabulary padding 20 -> 17 rows: trimmed 3 padding rows"),
                       (20, None), (None, None)):
        flags = ["--padded-vocab-size", str(rows)] if rows else []
        assert cli.main(["consolidate", str(tmp_path / "ckpt"), "--out", out] + flags) == 0
        printed = capsys.readouterr().out
        assert (line in printed) if line else "vocabulary padding" not in printed
        with safe_open(out, framework="pt") as f:
            assert torch.equal(f.get_tensor("w"), _fitted(full, rows or 20))
            assert (f.metadata()["vocab_size"], f.metadata()["padded_vocab_size"]) == \
                ("17", str(rows or 20))
    # below the token rows: refused, naming how many there are
    assert cli.main(["consolidate", str(tmp_path / "ckpt"), "--out", out,
                     "--padded-vocab-size", "16"]) == 2
    assert "the vocabulary has 17 tokens (20 rows saved); only padding rows can be trimmed" \
        in capsys.readouterr().err


def test_consolidate_refuses_other_rows_for_a_checkpoint_without_the_record(tmp_path, capsys):
    _vocab_checkpoint(tmp_path / "ckpt", record=False)
    out = str(tmp_path / "model.safetensors")
    assert cli.main(["consolidate", str(tmp_path / "ckpt"), "--out", out,
                     "--padded-vocab-size", "24"]) == 2
    assert "records no padded vocabulary" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert cli.main(["consolidate", str(tmp_path / "ckpt"), "--out", out]) == 0
    with safe_open(out, framework="pt") as f:
        assert "vocab_size" not in f.metadata()
