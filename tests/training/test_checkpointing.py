"""Which checkpoint to resume from is decided once, by rank 0, for every rank: a rank
that would read ``latest`` differently (or fail to read it) cannot send the ranks down
different paths through the load's collectives."""

import json
import os

import pytest

from megatron.training.checkpointing import META_FILE
from tests.launch import describe, fresh_python, run_ranks

WORKER = "tests/training/resume_worker.py"


def _resume(tmp_path, fault):
    load = tmp_path / "ckpt"
    (load / "global_step5").mkdir(parents=True)
    (load / "global_step5" / META_FILE).write_text(json.dumps({"args": {}, "world_size": 2}))
    (load / "latest").write_text("global_step5")
    out = tmp_path / "out"
    out.mkdir()
    results = run_ranks(2, [str(out), str(load), fault], script=WORKER, timeout=120)
    assert all(r.returncode == 0 for r in results), describe(results)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("fault", ["none", "rank1-sees-no-latest"])
def test_every_rank_resumes_from_the_tag_rank_0_read(tmp_path, fault):
    assert _resume(tmp_path, fault) == [{"iteration": 5}, {"iteration": 5}]


def test_rank_0_failing_to_read_latest_is_an_error_on_every_rank(tmp_path):
    results = _resume(tmp_path, "rank0-read-error")
    for result in results:
        assert "rank 0 could not read which checkpoint" in result.get("error", ""), results
        assert "Input/output error" in result["error"]


def test_saved_arguments_are_read_only_from_an_intact_objects_file(tmp_path):
    """A damaged objects.json whose text still parses must not decide the compatibility
    check (stopping the run with a made-up "was saved with --num-layers 7"): it fails its
    checksum, the arguments count as unknown, and the load falls back past it."""
    import types
    from deepspeed_ext.format.objects import OBJECTS_FILE
    from megatron.training.checkpointing import saved_meta
    from tests.deepspeed_ext.commit_helpers import commit_two_ranks
    save_dir = str(tmp_path)
    commit_two_ranks(save_dir, "global_step5", 5, 1.0,
                     objects={"client_state": {"args": {"num_layers": 2}}})
    engine = types.SimpleNamespace(moc=object())
    assert saved_meta(engine, save_dir, "global_step5") == {"args": {"num_layers": 2},
                                                           "world_size": 2}
    path = tmp_path / "global_step5" / OBJECTS_FILE
    text = path.read_text()
    assert '"num_layers": 2' in text
    path.write_text(text.replace('"num_layers": 2', '"num_layers": 7'))  # same size
    assert saved_meta(engine, save_dir, "global_step5") == {}


def test_a_baseline_save_names_its_checkpoint_in_latest_only_once_it_is_whole(tmp_path):
    """DeepSpeed writes `latest` before its own last barrier: a rank dying there left it
    naming a checkpoint without megatron_meta.json, and every restart stopped with exit 2.
    The trainer asks DeepSpeed not to write it, and writes it itself after the meta file."""
    import argparse
    import types
    import torch.distributed as dist
    from megatron.training.checkpointing import LATEST_FILE, ResumeState, save_checkpoint
    calls, saved = [], []

    def ds_save(save_dir, tag=None, client_state=None, save_latest=True):
        calls.append(save_latest)
        saved.append(client_state)
        (tmp_path / "ckpt" / tag).mkdir(parents=True)
        if save_latest:
            (tmp_path / "ckpt" / LATEST_FILE).write_text(tag)
    engine = types.SimpleNamespace(save_checkpoint=ds_save)
    scheduler = types.SimpleNamespace(state_dict=lambda: {})
    args = argparse.Namespace(save=str(tmp_path / "ckpt"))
    ours = not dist.is_initialized()  # tests/model leaves a one-rank world for the session
    if ours:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        tag = save_checkpoint(engine, args, scheduler,
                              ResumeState(iteration=5, consumed_train_samples=40))
    finally:
        if ours:
            dist.destroy_process_group()
    assert calls == [False]
    assert (tmp_path / "ckpt" / LATEST_FILE).read_text() == tag == "global_step5"
    assert json.loads((tmp_path / "ckpt" / tag / META_FILE).read_text())["iteration"] == 5
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "5"
    # a Namespace, as Megatron-DeepSpeed's tools read it (attributes, not keys)
    stored = saved[0]["args"]
    assert isinstance(stored, argparse.Namespace) and stored.save == str(tmp_path / "ckpt")
    assert (stored.tensor_model_parallel_size, stored.pipeline_model_parallel_size) == (1, 1)
    assert (stored.iteration, stored.consumed_train_samples) == (5, 40)


@pytest.mark.parametrize("args", [{"consumed_train_samples": 7}, None])
def test_a_load_reads_ours_and_megatron_deepspeeds_client_state(args):
    """Ours (args a dict in older checkpoints, a Namespace now; neither is needed) and
    Megatron-DeepSpeed's (scheduler under lr_scheduler, consumed samples in args, per-rank
    RNG states under rng_state)."""
    import argparse
    from megatron.training.checkpointing import resume_fields
    ours = {"iteration": 4, "consumed_train_samples": 32, "opt_param_scheduler": {"num_steps": 32},
            "rng_states": [{"python": 1}, {"python": 2}], "args": args}
    assert resume_fields(ours) == {"iteration": 4, "consumed_train_samples": 32,
                                   "opt_param_scheduler": {"num_steps": 32},
                                   "rng_states": [{"python": 1}, {"python": 2}]}
    theirs = {"iteration": 9, "lr_scheduler": {"num_steps": 72},
              "args": argparse.Namespace(**args) if args else None,
              "rng_state": [{"random_rng_state": 1, "np_rng_state": 2, "torch_rng_state": 3,
                             "cuda_rng_state": None, "rng_tracker_states": {}}]}
    assert resume_fields(theirs) == {
        "iteration": 9, "consumed_train_samples": 7 if args else 0,
        "opt_param_scheduler": {"num_steps": 72},
        "rng_states": [{"python": 1, "numpy": 2, "torch": 3, "cuda": None}]}
    from megatron.errors import ConfigError
    with pytest.raises(ConfigError, match="no LR scheduler state"):
        resume_fields({"iteration": 1})


@pytest.mark.parametrize("no_load_rng", [True, False])
def test_no_load_rng_keeps_the_seeded_state_after_a_moc_load(tmp_path, monkeypatch, no_load_rng):
    """MoC's load restores every rank's saved RNG state itself: --no-load-rng must undo it
    (it was ignored: the run went on with the checkpoint's random stream)."""
    import argparse
    import types
    import torch
    import torch.distributed as dist
    from megatron.training import checkpointing, recovery
    from tests.deepspeed_ext.commit_helpers import commit_two_ranks
    save_dir = str(tmp_path / "ckpt")
    commit_two_ranks(save_dir, "global_step5", 5, 1.0, objects={"client_state": {"args": {}}})

    def moc_load(load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True):
        torch.manual_seed(999)  # the saved state, as MoC's load sets it
        return os.path.join(load_dir, "global_step5"), {
            "opt_param_scheduler": {}, "iteration": 5, "consumed_train_samples": 40}
    engine = types.SimpleNamespace(moc=types.SimpleNamespace(rng_restored=True),
                                   load_checkpoint=moc_load)
    scheduler = types.SimpleNamespace(load_state_dict=lambda state: None)
    monkeypatch.setattr(recovery, "account_recovery", lambda *a, **k: None)
    args = argparse.Namespace(load=save_dir, no_load_optim=False, no_load_rng=no_load_rng,
                              moc_checkpoint=True, moc_two_level=False,
                              moe_expert_parallel_size=1)
    ours = not dist.is_initialized()  # tests/model leaves a one-rank world for the session
    if ours:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    try:
        torch.manual_seed(1234)  # this run's --seed
        state = checkpointing.load_checkpoint(engine, args, scheduler)
        drawn = torch.rand(3)
    finally:
        if ours:
            dist.destroy_process_group()
    assert state.iteration == 5
    torch.manual_seed(1234 if no_load_rng else 999)
    assert torch.equal(drawn, torch.rand(3))
    assert (state.rng_state is None) == no_load_rng


def test_a_lost_or_damaged_latest_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """A crash between a first commit's manifest and ``latest``, or a copy without it:
    the run started from scratch, and its first save set every checkpoint aside. MoC
    resumes from the newest complete checkpoint instead, as its own load would."""
    import types
    import torch.distributed as dist
    from deepspeed_ext.format import manifest as mf
    from deepspeed_ext.format import naming
    from megatron.training.checkpointing import newest_tag
    from tests.deepspeed_ext.commit_helpers import commit_two_ranks
    save_dir = str(tmp_path / "ckpt")
    for step in (10, 20):
        commit_two_ranks(save_dir, f"global_step{step}", step, float(step),
                         objects={"client_state": {"args": {"num_layers": 2}}})
    (tmp_path / "ckpt" / "global_step30").mkdir()  # a save that never finished
    latest = tmp_path / "ckpt" / naming.LATEST_FILE
    engine = types.SimpleNamespace(moc=object())
    ours = not dist.is_initialized()  # tests/model leaves a one-rank world for the session
    if ours:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    try:
        found = {}
        for case, content in [("intact", b"global_step10"), ("missing", None),
                              ("not utf-8", b"\xff\xfe"), ("incomplete", b"global_step30")]:
            if content is None:
                latest.unlink()
            else:
                latest.write_bytes(content)
            found[case] = newest_tag(engine, save_dir)
        latest.unlink()
        for tag in ("global_step10", "global_step20"):
            os.remove(os.path.join(save_dir, tag, mf.MANIFEST_FILE))
        found["none complete"] = newest_tag(engine, save_dir)
    finally:
        if ours:
            dist.destroy_process_group()
    meta = {"args": {"num_layers": 2}, "world_size": 2}
    assert found == {"intact": ("global_step10", meta), "missing": ("global_step20", meta),
                     "not utf-8": ("global_step20", meta), "incomplete": ("global_step20", meta),
                     "none complete": (None, {})}


@pytest.mark.parametrize("content", ["/etc", "../elsewhere", "global_step5/../../x", ".", "..",
                                     "a\\b", "escape", "global_step5\0", "\xff"])
def test_a_baseline_latest_must_name_a_tag_inside_load(tmp_path, content):
    """DeepSpeed's ``latest`` was joined into a path unchecked: an absolute path or
    ``..`` (or a tag directory linked outside) sent DeepSpeed's load, which unpickles
    what it finds, out of --load. It must be one directory name inside --load; anything
    else stops the run naming the file, before anything is loaded."""
    from megatron.training.checkpointing import find_latest_tag
    from megatron.errors import ConfigError
    load = tmp_path / "ckpt"
    (load / "global_step5").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", load / "escape")
    (load / "latest").write_bytes(content.encode("utf-8", "surrogateescape")
                                  if content != "\xff" else b"\xff")
    with pytest.raises(ConfigError, match="latest") as err:
        find_latest_tag(str(load))
    assert str(load / "latest") in str(err.value)


def test_a_baseline_latest_or_meta_file_is_read_only_up_to_its_cap(tmp_path):
    """``latest`` linked to /dev/zero was read forever; a huge or malformed
    megatron_meta.json was read whole or raised a stray error. Both are refused naming
    the file; a good ``latest`` still reads."""
    import types
    from megatron.training import checkpointing as ck
    from megatron.errors import ConfigError
    load = tmp_path / "ckpt"
    (load / "global_step5").mkdir(parents=True)
    (load / "latest").write_text("global_step5\n")
    assert ck.find_latest_tag(str(load)) == "global_step5"
    (load / "latest").unlink()
    os.symlink("/dev/zero", load / "latest")
    # In a child with a memory limit and a deadline: the old code read until memory ran out.
    out = fresh_python("import sys\n"
                       "from megatron.training.checkpointing import find_latest_tag\n"
                       "from megatron.errors import ConfigError\n"
                       "try:\n"
                       "    find_latest_tag(sys.argv[1])\n"
                       "except ConfigError as err:\n"
                       "    print('refused:', err)\n", args=[str(load)], memory_limit=4 << 30)
    assert len(out) == 1 and "larger than" in out[0]
    engine = types.SimpleNamespace(moc=None)
    meta = load / "global_step5" / META_FILE
    for text in ["[" * 100_000 + "]" * 100_000, '{"args": [1]}', '["x"]',
                 '{"args": {}, "pad": "' + " " * ck.META_MAX_BYTES + '"}']:
        meta.write_text(text)
        with pytest.raises(ConfigError, match=META_FILE):
            ck.saved_meta(engine, str(load), "global_step5")
    meta.write_text('{"args": {"num_layers": 2}, "world_size": 2}')
    assert ck.saved_meta(engine, str(load), "global_step5")["world_size"] == 2


@pytest.mark.parametrize("client", [None, [], {"iteration": "8"}, {"iteration": 8},
                                    {"iteration": 8, "consumed_train_samples": -1,
                                     "opt_param_scheduler": {}},
                                    {"iteration": 8, "consumed_train_samples": 64,
                                     "opt_param_scheduler": None}])
def test_an_exact_frames_client_state_is_checked_before_its_replay(client):
    """A frame's client_state was indexed after the replay began: a crafted or damaged one
    raised KeyError on one rank. The check runs with the frames, before the ranks agree."""
    from megatron.training.checkpointing import check_exact_client_state
    with pytest.raises(ValueError, match="client_state"):
        check_exact_client_state(client)
    check_exact_client_state({"iteration": 8, "consumed_train_samples": 64,
                              "opt_param_scheduler": {"num_steps": 8}})
