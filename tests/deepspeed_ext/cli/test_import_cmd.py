"""``moc-ckpt import`` as a user runs it: what it prints, what it writes, and how it
refuses bad input (exit 2) and checkpoints it cannot take (exit 1)."""

import argparse
import os
import shutil

import torch

from deepspeed_ext.cli.main import main
from deepspeed_ext.interop.safe_load import load_upstream_file
from deepspeed_ext.store.reader import find_loadable
from tests.deepspeed_ext.interop.upstream_samples import FIXTURE

ROOT = os.path.join(FIXTURE, "checkpoint")


def test_import_writes_a_loadable_checkpoint_and_says_what_it_carried(tmp_path, capsys):
    out = tmp_path / "moc"
    assert main(["import", ROOT, "--out", str(out), "--world-size", "4",
                 "--expert-parallel-size", "4"]) == 0
    text = capsys.readouterr()
    assert "iteration 6, 24 samples" in text.out and "2 MoE layers x 4 experts" in text.out
    assert "as 4 ranks with expert-parallel size 4" in text.out
    assert "add --l2-weight-decay" in text.out  # upstream's CPU run used torch.optim.Adam
    assert "16 stray expert tensors" in text.err  # DeepSpeed 0.19.8's copies, ignored
    assert find_loadable(str(out), checksums=True)[0] == "global_step6"
    assert main(["verify", str(out)]) == 0


def test_an_existing_checkpoint_directory_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "moc"
    assert main(["import", ROOT, "--out", str(out), "--weights-only"]) == 0
    assert "weights only (no optimizer state)" in capsys.readouterr().out
    assert main(["import", ROOT, "--out", str(out)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_a_layout_the_experts_do_not_fit_is_a_usage_error(tmp_path, capsys):
    assert main(["import", ROOT, "--out", str(tmp_path / "moc"), "--world-size", "3"]) == 2
    assert "--world-size/--expert-parallel-size" in capsys.readouterr().err


def test_an_architecture_moc_cannot_train_is_refused_naming_the_flag(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ROOT, ckpt)
    path = ckpt / "global_step6" / "mp_rank_00_model_states.pt"
    state = load_upstream_file(str(ckpt), str(path))
    args = dict(vars(state["args"]), model_type=None)  # our stand-in would be saved by its name
    state["args"] = argparse.Namespace(**dict(args, mlp_type="residual"))
    torch.save(state, path)
    assert main(["import", str(ckpt), "--out", str(tmp_path / "moc")]) == 1
    assert "--mlp-type" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "moc" / "latest")
    # Arguments that do not describe the files (SwiGLU's doubled rows are not there).
    state["args"] = argparse.Namespace(**dict(args, swiglu=True))
    torch.save(state, path)
    assert main(["import", str(ckpt), "--out", str(tmp_path / "moc")]) == 1
    err = capsys.readouterr().err
    assert "dense_h_to_4h.bias is (128,), but the stored arguments describe (256,)" in err


def test_no_latest_and_a_bad_tag_are_named(tmp_path, capsys):
    assert main(["import", str(tmp_path), "--out", str(tmp_path / "moc")]) == 1
    assert "latest" in capsys.readouterr().err
    assert main(["import", ROOT, "--tag", "../x", "--out", str(tmp_path / "moc")]) == 1
    assert "tag" in capsys.readouterr().err
