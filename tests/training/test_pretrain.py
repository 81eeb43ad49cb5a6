"""End-to-end runs of pretrain_gpt_moe.py on 1, 2 and 4 CPU ranks (gloo).

Each run is a real job on a real corpus (standard-library sources): DeepSpeed ZeRO-2
with expert parallelism, checkpoints through DeepSpeed's own save/load.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.launch import REPO, describe, free_port, run_ranks
from tests.shm import new_shm_dir, stop_keepers

TINY = ["--config", "configs/tiny.yaml", "--split", "90,10,0"]


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _train_losses(path):
    return [r["lm_loss"] for r in _metrics(path) if r["kind"] == "train"]


def _assert_ok(results):
    assert all(r.returncode == 0 for r in results), describe(results)


@pytest.mark.parametrize("nproc", [2, 4])
def test_tiny_run_trains_with_expert_parallelism(corpus, tmp_path, nproc):
    metrics = tmp_path / "m.jsonl"
    results = run_ranks(nproc, TINY + [
        "--data-path", corpus, "--moe-expert-parallel-size", str(nproc), "--train-iters", "24",
        "--lr", "0.003", "--lr-warmup-iters", "2", "--log-interval", "6", "--eval-interval", "12",
        "--metrics-file", str(metrics)])
    _assert_ok(results)
    losses = _train_losses(metrics)
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    log = results[0].output
    assert f"world size {nproc}, expert-parallel {nproc}" in log
    assert " iteration       24/      24 | consumed samples:          192 |" in log
    for field in ("elapsed time per iteration (ms):", "tokens per second:", "learning rate:",
                  "lm loss:", "moe aux loss:", "grad norm:", "samples per second:",
                  "tokens per gpu per second (tgs):"):
        assert field in log
    # Megatron-DeepSpeed's fields: ZeRO 2 in fp32 has a loss scale of 1.0, as upstream prints
    assert ("| consumed tokens:         6144 |" in log and "| loss scale: 1.0 |" in log
            and "| actual seqlen:    32 |" in log and "| number of nan iterations:   0 |" in log)
    assert "validation loss at iteration 12" in log
    assert "iteration" not in results[1].output  # only rank 0 logs


def test_single_process_python_run(corpus, tmp_path):
    """`python pretrain_gpt_moe.py` with no launcher: one rank, its own rendezvous."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "pretrain_gpt_moe.py", *TINY, "--data-path", corpus,
                           "--moe-expert-parallel-size", "1", "--train-iters", "4",
                           "--metrics-file", str(metrics)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(_train_losses(metrics)) == 4


def test_torchrun_launch(corpus, tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "pretrain_gpt_moe.py", *TINY, "--data-path", corpus,
           "--train-iters", "2", "--lr-warmup-iters", "0", "--metrics-file", str(metrics),
           "--no-bias-gelu-fusion"]  # a Megatron-DeepSpeed switch: one line, rank 0 only
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(_train_losses(metrics)) == 2
    assert proc.stdout.count("> --no-bias-gelu-fusion: nothing to switch off here") == 1


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """8 iterations in one go, through the `deepspeed` launcher, saved at the end."""
    out = tmp_path_factory.mktemp("uninterrupted")
    port = free_port()
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2", "--master_port",
           str(port), "pretrain_gpt_moe.py", *TINY, "--data-path", corpus,
           "--save", str(out / "ckpt"), "--metrics-file", str(out / "m.jsonl")]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # DeepSpeed's CPU all-reduce buffers of this run are unlinked at the end
    import glob
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []
    return out


def _tensors(obj, prefix=""):
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}/{i}")


def _checkpoint_tensors(tag_dir):
    out = {}
    for name in sorted(os.listdir(tag_dir)):
        if name.endswith(".pt"):
            # Files this test's own runs just wrote; DeepSpeed pickles non-tensor objects.
            state = torch.load(os.path.join(tag_dir, name), map_location="cpu", weights_only=False)
            state.pop("client_state", None)  # holds RNG states compared through the losses
            for key, value in _tensors(state):
                out[name + key] = value
    return out


def test_resume_is_bitwise_exact(corpus, tmp_path, uninterrupted):
    """4 iterations + save + exit, then a fresh job loads and runs 4 more: identical."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = TINY + ["--data-path", corpus, "--save", str(ckpt), "--metrics-file", str(metrics)]
    first = run_ranks(2, common + ["--exit-interval", "4"])
    _assert_ok(first)
    assert "exiting at iteration 4" in first[0].output
    second = run_ranks(2, common + ["--load", str(ckpt)])
    _assert_ok(second)
    assert "loaded checkpoint" in second[0].output and "at iteration 4" in second[0].output

    assert _metrics(metrics) == _metrics(uninterrupted / "m.jsonl")  # losses, lr, grad norms
    ours = _checkpoint_tensors(ckpt / "global_step8")
    theirs = _checkpoint_tensors(uninterrupted / "ckpt" / "global_step8")
    assert ours.keys() == theirs.keys() and len(ours) > 20
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, different[:5]


def test_load_of_missing_directory_starts_from_scratch(corpus, tmp_path):
    results = run_ranks(2, TINY + ["--data-path", corpus, "--exit-interval", "1",
                                   "--load", str(tmp_path / "nothing-here")])
    _assert_ok(results)
    assert "no checkpoint found at --load" in results[0].output


def test_incompatible_checkpoint_names_the_setting(corpus, uninterrupted):
    results = run_ranks(2, TINY + ["--data-path", corpus, "--hidden-size", "64",
                                   "--load", str(uninterrupted / "ckpt")])
    for r in results:
        assert r.returncode == 2, describe(results)
        assert "saved with --hidden-size 32 but this run has --hidden-size 64" in r.output
        assert "Traceback" not in r.output


BAD_INPUTS = {
    "unknown flag": (["--num-layerz", "2"], "unrecognized arguments: --num-layerz"),
    "experts vs expert parallel": (["--num-experts", "3"],
                                   "--num-experts (3) must be divisible by --moe-expert-parallel-size (2)"),
    "world vs expert parallel": (["--moe-expert-parallel-size", "4"],
                                 "world size (2) must be divisible by --moe-expert-parallel-size (4)"),
    "global batch": (["--global-batch-size", "6"], "--global-batch-size (6) must be divisible by"),
    "missing data": (["--data-path", "/nonexistent/corpus"], "--data-path: missing file"),
    "tokenizer files": (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_stops_every_rank_with_exit_2(corpus, case):
    extra, needle = BAD_INPUTS[case]
    args = TINY + ["--data-path", corpus] + extra
    results = run_ranks(2, args, timeout=120)
    for r in results:
        assert r.returncode == 2, describe(results)
        assert needle in r.output, describe(results)
        assert "Traceback" not in r.output, describe(results)


def test_unknown_yaml_key_stops_every_rank(corpus, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("num-layers: 2\nnum-expertz: 4\n")
    results = run_ranks(2, TINY + ["--config", str(cfg), "--data-path", corpus], timeout=120)
    for r in results:
        assert r.returncode == 2 and "unknown key 'num-expertz'" in r.output, describe(results)


def test_moc_checkpoint_resumes_on_another_layout(corpus, tmp_path):
    """--moc-checkpoint with PEC K=1: save on 2 ranks (EP 2), resume on 4 ranks (EP 4)."""
    ckpt = tmp_path / "ckpt"
    common = TINY + ["--data-path", corpus, "--moc-checkpoint", "--moc-pec-k", "1",
                     "--moc-pec-policy", "load-aware", "--save", str(ckpt), "--save-interval", "2"]
    first = run_ranks(2, common + ["--exit-interval", "4"])
    _assert_ok(first)
    assert "MoC checkpointing on: K = 1 of 4 experts" in first[0].output
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    manifest = json.load(open(ckpt / "global_step4" / "manifest.json"))
    assert sorted(v["step"] for v in manifest["expert_index"].values()).count(4) == 1
    first_attempt = json.load(open(ckpt / "moc-attempt.json"))["attempt_started"]
    assert first_attempt == manifest["extra"]["attempt_started"]  # rank 0's, recorded at start
    second = run_ranks(4, common + ["--moe-expert-parallel-size", "4", "--load", str(ckpt)])
    _assert_ok(second)
    # the second job's start is recorded: the first one's late committers stand down
    second_attempt = json.load(open(ckpt / "moc-attempt.json"))["attempt_started"]
    assert second_attempt > first_attempt
    assert second_attempt == json.load(open(ckpt / "global_step8" / "manifest.json"))[
        "extra"]["attempt_started"]
    assert "loaded checkpoint" in second[0].output and "at iteration 4" in second[0].output
    assert " iteration        8/       8 |" in second[0].output
    # The resumed run's arguments differ in layout only; a model change is still refused.
    bad = run_ranks(2, common + ["--hidden-size", "64", "--load", str(ckpt)], timeout=120)
    assert all(r.returncode == 2 and "--hidden-size" in r.output for r in bad), describe(bad)


def test_two_level_run_and_resume_match_an_uninterrupted_run(corpus, tmp_path, uninterrupted):
    """--moc-two-level with a snapshot every iteration changes nothing in training (a
    fresh start included), and stopping after 4 (the end persists step 4, which was not
    due for storage) then resuming gives the uninterrupted run's metrics to the bit."""
    shm = new_shm_dir()
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = TINY + ["--data-path", corpus, "--save", str(ckpt), "--load", str(ckpt),
                     "--metrics-file", str(metrics), "--moc-checkpoint", "--moc-two-level",
                     "--moc-snapshot-interval", "1", "--moc-persist-interval", "5",
                     "--moc-shm-dir", shm]
    try:
        first = run_ranks(2, common + ["--exit-interval", "4"])
        _assert_ok(first)
        assert "persisting the newest snapshot global_step4" in first[0].output
        second = run_ranks(2, common)
        _assert_ok(second)
        assert "loaded" in second[0].output and "global_step4" in second[0].output
        records = _metrics(metrics)
        # the resume's recovery record: K = all experts, so nothing was lost
        recovery = [r for r in records if r["kind"] == "moc" and "plt" in r]
        assert len(recovery) == 1 and recovery[0]["plt"] == 0.0, recovery
        # each run's end records the job's ETTR
        assert [r["iteration"] for r in records if "ettr" in r] == [4, 8]
        assert recovery[0]["iterations_lost"] == 0
        assert [r for r in records if r["kind"] != "moc"] == _metrics(uninterrupted / "m.jsonl")
        assert not os.path.exists(shm)
    finally:
        stop_keepers(shm)


def test_recovery_reports_plt_and_dynamic_k_doubles(corpus, tmp_path):
    """PEC K=1: stop at 4, resume; the recovery's lost tokens (the token ledger) equal the
    PEC policy's unsaved tokens saved in that checkpoint (two independent bookkeepers),
    and with a tiny --moc-plt-threshold dynamic K doubles K for the next checkpoints."""
    from deepspeed_ext.format.objects import read_objects_file
    ckpt = tmp_path / "ckpt"
    common = TINY + ["--data-path", corpus, "--moc-checkpoint", "--moc-pec-k", "1",
                     "--save", str(ckpt), "--save-interval", "2"]
    _assert_ok(run_ranks(2, common + ["--exit-interval", "4"]))
    second = run_ranks(2, common + ["--load", str(ckpt), "--moc-dynamic-k",
                                    "--moc-plt-threshold", "0.001"])
    _assert_ok(second)
    events = [json.loads(line) for line in open(ckpt / "moc-events.jsonl")]
    assert [e["kind"] for e in events] == ["start", "ettr", "recovery", "start", "ettr"]
    event = events[2]
    assert event["iteration"] == 4 and event["source"] == "storage"
    assert event["iterations_lost"] == 0 and event["loss"]["exact"]
    unsaved = read_objects_file(str(ckpt / "global_step4")).tree["pec_policy"]["unsaved_tokens"]
    assert event["loss"]["lost"] == unsaved and sum(map(sum, unsaved)) > 0
    assigned = event["loss"]["assigned"]
    expected = sum(sum(lost) / total for lost, total in zip(unsaved, assigned)) / len(assigned)
    assert event["plt"] == event["cumulative_plt"] == expected > 0.001
    assert event["k"] == 2
    log = second[0].output
    assert "recovered iteration 4 from storage" in log and "PLT" in log
    assert "dynamic K: accumulated PLT" in log and "K 1 -> 2 experts per MoE layer" in log
    manifest = json.load(open(ckpt / "global_step8" / "manifest.json"))
    assert manifest["extra"]["pec_k"] == 2
    saved_at_8 = [k for k, v in manifest["expert_index"].items() if v["step"] == 8]
    assert len(saved_at_8) == 2 * manifest["layout"]["num_moe_layers"], saved_at_8


def test_a_shm_dir_one_node_cannot_trust_stops_every_rank_before_training(corpus, tmp_path):
    """Two simulated nodes; node 1's directory in --moc-shm-dir is a link planted to a
    directory elsewhere (where the job would have written its snapshots, keeper log and
    socket). Rank 1 refuses it, and rank 0, whose node is fine, must stop too, before
    the first iteration, with the reason naming --moc-shm-dir (not hang in a collective)."""
    shm = new_shm_dir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.mkdir(shm, 0o700)
    os.symlink(elsewhere, os.path.join(shm, "node1"))
    try:
        results = run_ranks(2, TINY + ["--data-path", corpus, "--save", str(tmp_path / "ckpt"),
                                       "--moc-checkpoint", "--moc-two-level", "--moc-shm-dir", shm,
                                       "--moc-ranks-per-node", "1"], timeout=180)
        for r in results:
            assert r.returncode != 0, describe(results)
            assert "node1 is a symbolic link" in r.output and "--moc-shm-dir" in r.output, \
                describe(results)
            assert " iteration " not in r.output, describe(results)
        assert os.listdir(elsewhere) == []
    finally:
        stop_keepers(shm)
