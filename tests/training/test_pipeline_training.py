"""Pipeline parallelism through the trainer (--pipeline-model-parallel-size): PP = 2 on 4
ranks, and PP = 2 x TP = 2 on 4, against PP = 1 on 2 ranks, the same model, data and
steps; their MoC checkpoints, loaded under another layout; recovery to the bit from the
peers' memory, and of a stage that loses its state, alone (upstream logs, with and
without tensor parallelism) or with every stage; and what is refused."""

import json
import os
import re
import subprocess

import pytest
import torch

from tests.launch import REPO, describe, run_ranks
from tests.shm import new_shm_dir, stop_keepers

# every layer MoE: a stage without experts is refused (test_gpt_moe_pipe.py)
TINY = ["--config", "configs/tiny.yaml", "--split", "90,10,0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--train-iters", "6", "--eval-interval", "3",
        "--eval-iters", "1", "--log-interval", "1", "--topk", "1", "--expert-interval", "1",
        "--zero-stage", "1", "--make-vocab-size-divisible-by", "16"]

# PP 2 x TP 2 x EP 2 (experts replicated over the tensor-parallel pair), DP 1; the
# vocabulary padded to a multiple of 8 x T = 16, as TINY's is; in exact mode with upstream
# logs, so that a stage's loss is checked against this run (the mode changes no value)
TP_PP = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
         "--make-vocab-size-divisible-by", "8", "--moc-mode", "exact", "--moc-window", "2",
         "--moc-upstream-logging"]


def _records(path):
    with open(path) as f:
        return {(r["kind"], r["iteration"]): (r["lm_loss"], r.get("moe_aux_loss"), r.get("grad_norm"))
                for r in map(json.loads, f) if r["kind"] in ("train", "valid")}


@pytest.fixture(scope="module")
def shm():
    """The keepers' shared-memory directory of the module's exact-mode runs."""
    where = new_shm_dir()
    yield where
    stop_keepers(where)


@pytest.fixture(scope="module")
def runs(corpus, shm, tmp_path_factory):
    """PP = 1 on 2 ranks, PP = 2 on 4 and PP = 2 x TP = 2 on 4 (key "tp"), 6 steps each,
    with MoC checkpoints at 3 (every expert) and 6 (PEC, K = 2 of each layer's 4):
    ``{layout: (records, rank 0's log, save dir)}``."""
    out = {}
    for layout, nproc, flags in ((1, 2, []), (2, 4, ["--pipeline-model-parallel-size", "2"]),
                                 ("tp", 4, TP_PP + ["--moc-shm-dir", shm])):
        where = tmp_path_factory.mktemp(f"pp{layout}")
        results = run_ranks(nproc, TINY + flags + [
            "--data-path", corpus, "--metrics-file", str(where / "m.jsonl"), "--moc-checkpoint",
            "--save", str(where / "ckpt"), "--save-interval", "3", "--moc-pec-k", "2"],
            timeout=240)
        assert all(r.returncode == 0 for r in results), describe(results)
        out[layout] = (_records(where / "m.jsonl"), results[0].output, where / "ckpt")
    return out


def _close(got, want, rel):
    assert got.keys() <= want.keys() and got
    for key, values in got.items():
        for value, expected in zip(values, want[key]):
            if expected is not None:
                assert value == pytest.approx(expected, rel=rel), (key, values, want[key])


def test_two_pipeline_stages_train_as_one(runs):
    """ZeRO-1, 6 steps of 2 micro-batches, top-1: every logged LM loss, aux loss and
    gradient norm of PP = 2 (DeepSpeed's pipeline engine, each stage one decoder layer
    and 2 of the 4 experts per rank) agrees with PP = 1's within 1e-5 relative (measured:
    equal to 1e-7: the tied embedding's gradient is summed over two stages). The LM and
    aux losses, which the engine reports only summed, come from the last stage's loss
    function."""
    assert runs[1][0].keys() == runs[2][0].keys() and len(runs[1][0]) == 6 + 2
    _close(runs[2][0], runs[1][0], 1e-5)


def test_pipeline_stages_with_tensor_parallelism_train_as_one(runs):
    """PP = 2 x TP = 2 (megatron-core's layers inside each stage, the vocabulary of the
    tied embedding and head split over the pair, DeepSpeed's pipe x data x model topology,
    experts replicated over the pair): every LM loss, aux loss and gradient norm agrees
    with PP = 1's within 1e-5 (measured: 7e-8 apart; split matmuls are summed in
    another order)."""
    assert runs["tp"][0].keys() == runs[1][0].keys()
    _close(runs["tp"][0], runs[1][0], 1e-5)


def test_moc_checkpoints_of_pipeline_stages(runs, tmp_path):
    """The PP = 2 run's checkpoints hold the whole model under ``GPTMoEModel``'s names,
    as the PP = 1 run's do: the same tensors, the tied word embedding once; each stage's
    MoE layers keep their own ordinals (the stages' experts would collide otherwise);
    the 4 ranks write a balanced share (max/mean under 1.1: the tied embedding's weights
    written by either stage holding it; measured 1.05, 1.13 without); the gate counts of
    both stages reach the token ledger and the PEC policy, which saved the same experts.
    The same for PP = 2 x TP = 2, whose tensor-parallel parts are written whole, and which
    ``moc-ckpt consolidate`` turns into the whole model."""
    from deepspeed_ext.store.reader import CheckpointReader
    balance = [float(line.split("max/mean ")[1].split(")")[0])
               for line in runs[2][1].splitlines() if line.startswith("[moc] saved")]
    assert len(balance) == 2 and max(balance) < 1.1, balance
    for tag in ("global_step3", "global_step6"):
        whole = {}
        for layout in (1, 2, "tp"):
            with CheckpointReader(str(runs[layout][2]), tag) as reader:
                whole[layout] = ({key: reader.read_full(*key) for key in reader.keys()},
                                 reader.objects()["token_ledger"], reader.expert_versions())
        tensors1, ledger1, versions1 = whole[1]
        for layout in (2, "tp"):  # with TP: the split tensors whole, as PP = 1 holds them
            tensors2, ledger2, versions2 = whole[layout]
            assert tensors1.keys() == tensors2.keys()
            assert ("word_embeddings.weight", "exp_avg") in tensors2
            assert ("layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight",
                    "fp32") in tensors2
            # With TP, split matmuls sum in another order, and Adam turns the near-zero
            # gradients of the key bias into steps of either sign (measured: 9e-7 apart
            # on values of 5e-7; 1e-6 at DP 2): hence TP's wider absolute tolerance.
            atol = 1e-5 if layout == "tp" else 1e-6
            for key, value in tensors1.items():
                torch.testing.assert_close(tensors2[key], value, rtol=1e-4, atol=atol,
                                           msg=str((layout, key)))
            assert ledger1 == ledger2 and sum(ledger2["cumulative"][1]) == int(tag[-1]) * 8 * 32
            assert versions1 == versions2
            if tag == "global_step6":  # K = 2: two experts of each layer from step 3
                assert [step for step, _ in versions2.values()].count(3) == 4, versions2
    # ``moc-ckpt consolidate`` (the same reader, through the command once): PP 2 x TP 2's
    # step 6 as the whole model, every tensor of PP = 1's
    from safetensors.torch import load_file
    out = tmp_path / "tp.safetensors"
    subprocess.run([os.path.join(os.path.dirname(os.sys.executable), "moc-ckpt"), "consolidate",
                    str(runs["tp"][2]), "--tag", "global_step6", "--out", str(out), "--optimizer"],
                   check=True, capture_output=True, cwd=REPO)
    consolidated = load_file(str(out))
    assert len(consolidated) == len(tensors1)
    for (name, kind), value in tensors1.items():
        torch.testing.assert_close(consolidated[name if kind == "fp32" else f"{name}.{kind}"],
                                   value, rtol=1e-4, atol=1e-5, msg=name)


def test_moc_checkpoints_load_under_another_pipeline_size(runs, corpus, tmp_path):
    """Step 3's checkpoint of PP = 2 loaded by PP = 1 (2 ranks), and PP = 1's by PP = 2 x
    TP = 2 (4 ranks): steps 4-6 continue as the loading layout's own run did, within 1e-5
    (measured: equal to 1e-7). (PP = 2 loads PP = 2's in the recovery tests.)"""
    layouts = {1: ["--pipeline-model-parallel-size", "1"],
               "tp": TP_PP[:6]}  # without exact mode: the loading alone
    for saved, target, nproc in ((2, 1, 2), (1, "tp", 4)):
        load = tmp_path / f"pp{target}-from-pp{saved}"
        os.makedirs(load)
        os.symlink(runs[saved][2] / "global_step3", load / "global_step3")
        (load / "latest").write_text("global_step3")
        results = run_ranks(nproc, TINY + layouts[target] + [
            "--data-path", corpus, "--metrics-file", str(load / "m.jsonl"), "--moc-checkpoint",
            "--load", str(load)], timeout=240)
        assert all(r.returncode == 0 for r in results), describe(results)
        got = _records(load / "m.jsonl")
        assert sorted(got) == [("train", 4), ("train", 5), ("train", 6), ("valid", 6)]
        _close(got, runs[target][0], 1e-5)


def _elastic(tmp_path, corpus, extra, nproc="4", restarts="2"):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    cmd = ["bash", "scripts/run_elastic.sh", nproc, restarts, *TINY, "--pipeline-model-parallel-size",
           "2", "--data-path", corpus, "--save", str(ckpt), "--load", str(ckpt),
           "--metrics-file", str(metrics), "--moc-checkpoint", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    events = [json.loads(line) for line in open(ckpt / "moc-events.jsonl")]
    return _records(metrics), proc.stdout, events


def test_a_pipeline_run_recovers_from_the_peers_memory_to_the_bit(runs, corpus, tmp_path):
    """PP = 2 x TP = 2 on 4 ranks, two-level snapshots every step replicated to the other
    node's keeper (2 ranks per node: node 0 is stage 0's tensor-parallel pair); node 0
    loses its memory at the top of step 5 and torchrun's restart rebuilds stage 0's
    snapshots, split tensors included, from stage 1's node. Every loss and gradient norm
    equals the run that never failed (the fixture's PP 2 x TP 2 run, whose exact mode
    changes no value), to the bit. One run for both layouts: the peers' rebuild under
    tensor parallelism alone had its own 4-rank test, and under a pipeline alone another.
    (Exact mode's replay under a pipeline, in place, is the next test; after a restart it
    is the same replay, from frames the restart finds in memory.)"""
    shm = new_shm_dir()
    try:
        got, log, events = _elastic(tmp_path, corpus, [
            "--save-interval", "3", "--moc-two-level", "--moc-snapshot-interval", "1",
            "--moc-persist-interval", "3", "--moc-shm-dir", shm, "--moc-redundancy",
            "replicate", "--moc-ranks-per-node", "2", "--moc-fault", "lose-memory@5:rank=0",
            *TP_PP[2:6]])
    finally:
        stop_keepers(shm)
    assert "from the peers' memory" in log and "tensor-parallel 2" in log
    recoveries = [(e["source"], e["iteration"]) for e in events if e["kind"] == "recovery"]
    # step 4's copy to the peers runs beside step 5: on a busy machine node 0 can lose
    # its memory before it lands, and the restart takes step 3's (then replays step 4):
    # the same losses either way
    assert len(recoveries) == 1 and recoveries[0][0] == "memory+peers", events
    assert recoveries[0][1] in (3, 4), events
    assert got == runs["tp"][0]


def test_a_stage_that_loses_its_state_recovers_in_place_to_the_bit(runs, corpus, tmp_path):
    """Exact mode (W = 2: windows of frames 1-2, 3-4) with upstream logs. At the top of
    step 4 stage 1 loses its weights, optimizer state and logs in place (the processes
    live on): it alone restores the window of frames 1-2 and replays steps 2-3 from stage
    0's logs and the all-reduces stage 0 kept, while stage 0 waits. At the top of step 6
    both stages lose theirs: no neighbour holds their logs, so every stage restores the
    window of frames 3-4 and replays steps 4-5 through the pipeline, and the log says why.
    Every loss and gradient norm equals the run without a failure, to the bit. With
    dropout: the replay draws its masks from the frame's generator state (building the
    replay's data loader draws too: restored after it; measured, the masks differed). With
    top-2 gating: its second expert is sampled in evaluation too, and the evaluation at 3
    is not replayed: the generators are set back after the replay (measured: steps 4-6
    differed)."""
    shm = new_shm_dir()
    flags = TINY + ["--data-path", corpus, "--pipeline-model-parallel-size", "2",
                    "--hidden-dropout", "0.1", "--topk", "2", "--moc-checkpoint", "--save-interval", "100",
                    "--moc-mode", "exact", "--moc-window", "2", "--moc-shm-dir", shm,
                    "--moc-upstream-logging"]
    try:
        runs_out = {}
        for name, faults in (("reference", []), ("faults", [
                "--moc-fault", "lose-stage@4:rank=2", "--moc-fault", "lose-stage@6:rank=0",
                "--moc-fault", "lose-stage@6:rank=3"])):
            results = run_ranks(4, flags + faults + [
                "--metrics-file", str(tmp_path / f"{name}.jsonl"), "--save",
                str(tmp_path / name)], timeout=240)
            assert all(r.returncode == 0 for r in results), describe(results)
            runs_out[name] = (_records(tmp_path / f"{name}.jsonl"), results[0].output)
    finally:
        stop_keepers(shm)
    log = runs_out["faults"][1]
    assert "localized: stage(s) [1] replayed iterations 2..3 from their neighbours' upstream " \
           "logs while the others waited" in log, log[-3000:]
    assert "global: every stage replayed iterations 4..5 (stages [0, 1] failed together" in log
    # the logs at the end: steps 4-6 (both stages lost theirs at 6, replayed 4-5, then
    # trained 6), of 2 micro-batches of [2, 32, 32] fp32 hidden states, + positions and
    # aux forward; their gradients (+ aux) back; the peak: 4 steps kept (two windows) and
    # the one being logged
    per_step = 2 * (2 * 32 * 32 * 4 + 2 * 32 * 8 + 4), 2 * (2 * 32 * 32 * 4 + 4)
    line = next(x for x in log.splitlines() if x.startswith("[moc] upstream logs: stage"))
    assert line == (f"[moc] upstream logs: stage 0 {3 * per_step[0] / 2 ** 20:.2f} MiB (peak "
                    f"{5 * per_step[0] / 2 ** 20:.2f}), stage 1 {3 * per_step[1] / 2 ** 20:.2f} "
                    f"MiB (peak {line.split('peak ')[2].split(')')[0]}) per rank; iterations 4..6 "
                    f"kept (4 = two windows)"), line
    assert runs_out["faults"][0] == runs_out["reference"][0]
    events = [json.loads(x) for x in open(tmp_path / "faults" / "moc-events.jsonl")]
    assert [(e["source"], e["iteration"], e["iterations_lost"]) for e in events
            if e["kind"] == "recovery"] == [("localized in place", 1, 2), ("global in place", 3, 2)]
    assert runs_out["reference"][0] != runs[2][0]  # the dropout masks count


def test_a_crashed_stage_recovers_alone_in_job_to_the_bit(runs, corpus, tmp_path):
    """PP = 2 x TP = 2 and one hot spare under MoC's supervisor (``--moc-restart in-job``):
    rank 3 (stage 1, a tensor-parallel pair with rank 2) is SIGKILLed at the top of step
    4. The spare takes rank 3. Stage 0's ranks keep their processes, the state of step 3
    and their upstream logs; stage 1 (the spare and rank 2) restores the window of frames
    1-2 from the node's memory and replays steps 2-3 alone, from stage 0's logs (each rank
    from its counterpart of the same tensor-parallel rank) and the all-reduces across the
    pipeline that stage 0 kept (the gradient norm's, the tied embedding's per vocabulary
    slice), its own all-reduces inside the pair run again. Every loss and gradient norm
    equals the run that never failed, to the bit. (Before the in-job teardown dropped the
    pipeline's activations in flight, stage 0's engine outlived it, and a survivor waited
    out the group timeout: measured, 10 minutes.)"""
    shm = new_shm_dir()
    try:
        got, log, events = _elastic(tmp_path, corpus, [
            *TP_PP, "--moc-shm-dir", shm, "--save-interval", "3", "--moc-pec-k", "2",
            "--moc-restart", "in-job", "--moc-spares", "1", "--moc-fault", "crash@4:rank=3"],
            nproc="5", restarts="0")
    finally:
        stop_keepers(shm)
    assert "[moc] recovered in " in log and "localized in-job: stage 1 replayed iterations " \
           "2..3 from its neighbours' upstream logs; the other stages kept their state and " \
           "resume at iteration 4" in log, log[-3000:]
    assert [(e["source"], e["iteration"], e["iterations_lost"]) for e in events
            if e["kind"] == "recovery"] == [("exact replay from memory, localized to stage 1", 3, 0)]
    rounds = sorted((e["rank"], e["role"]) for e in events if e["kind"] == "in-job-round")
    assert rounds == [(0, "survivor"), (1, "survivor"), (2, "survivor"), (3, "spare")], rounds
    assert got == runs["tp"][0]


@pytest.mark.parametrize("extra, needle", [
    (["--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size 2 with --zero-stage 2: DeepSpeed's pipeline engine supports "
     "ZeRO stage 0 or 1 only"),
    (["--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--tensor-model-parallel-size",
      "2", "--enable-expert-tensor-parallelism", "--moe-schedule", "parm-s1"],
     "--pipeline-model-parallel-size 2 with --moe-schedule parm-s1: Parm's schedules are not "
     "supported inside pipeline stages yet"),
    (["--pipeline-model-parallel-size", "3", "--zero-stage", "1"],
     "world size \\(4\\) must be divisible by --pipeline-model-parallel-size \\(3\\)"),
    (["--moc-checkpoint", "--moc-upstream-logging"],
     "--moc-upstream-logging needs --moc-mode exact .* and --pipeline-model-parallel-size > 1"),
    (["--moc-checkpoint", "--moc-mode", "exact", "--moc-fault", "lose-stage@3:rank=0"],
     "--moc-fault lose-stage needs --pipeline-model-parallel-size > 1 and --moc-mode exact"),
])
def test_what_pipeline_parallelism_does_not_support_is_refused(extra, needle):
    from tests.training.refusals import refusal
    # 8 ranks with tensor parallelism: a stage of 4 holds T 2 x EP 2
    assert re.search(needle, refusal(extra, 8 if "--tensor-model-parallel-size" in extra else 4))


def test_an_upstream_log_over_its_budget_is_refused_naming_the_flags():
    """Checked before training (a fixed --moc-window) or once the window is chosen: 4
    stages, 8 micro-batches of 4 x 128 tokens of hidden 1024 in bf16 put about 16 MiB a
    step on a middle stage (activations and gradients, 1 MiB each per micro-batch), 112
    MiB for two windows of 3 and the step being logged."""
    import argparse
    from types import SimpleNamespace

    from megatron.errors import ConfigError
    from megatron.training.pipeline import check_upstream_log
    log = SimpleNamespace(retain_iterations=2, engine=SimpleNamespace())
    args = argparse.Namespace(micro_batch_size=4, seq_length=128, hidden_size=1024, fp16=False,
                              bf16=True, pipeline_model_parallel_size=4,
                              gradient_accumulation_steps=8, moc_upstream_log_gb=0.1)
    with pytest.raises(ConfigError, match=r"takes 0\.110 GiB of host memory, over "
                                          r"--moc-upstream-log-gb 0\.1; raise it, or lower "
                                          r"--moc-window, --micro-batch-size"):
        check_upstream_log(log, args, 3)
    args.moc_upstream_log_gb = 0.2
    check_upstream_log(log, args, 3)
    assert log.retain_iterations == 6
