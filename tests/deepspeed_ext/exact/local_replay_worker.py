"""A rank of the localized-recovery test: a 2-stage GPT-MoE pipeline on 4 ranks (2
data-parallel ranks per stage, experts over them), ZeRO-1 with gradient clipping, 4
micro-batches per step, upstream and cross-stage logs on every rank. After step 4 stage 1
loses its state: it restores its state of step 2 and replays steps 3-4 alone from stage
0's logs; after step 6 stage 0 does the same (state of step 4, steps 5-6). Each time the
failed stage's ranks compare their state after the replay (fp32 masters, moments,
compute weights, step counters) and the sends they logged again with what they held
before the failure, bit for bit. Then step 7, and an evaluation batch; what the logs hold
(4 steps kept) goes to OUT_DIR/rank<R>.json too.

    local_replay_worker.py OUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MICRO, MICRO_BATCH, SEQ, VOCAB = 4, 2, 16, 64


def _batches(first, last, dp_rank):
    for step in range(first, last + 1):
        for micro in range(MICRO):
            gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
            positions = torch.arange(SEQ).expand(MICRO_BATCH, -1).contiguous()
            yield ((tokens[:, :-1].contiguous(), positions),
                   (tokens[:, 1:].contiguous(), torch.ones(MICRO_BATCH, SEQ)))


def _capture(engine, naming):
    from deepspeed_ext.state import describe_local_state, optimizer_scalars
    frags = {f.key: f.tensor.detach().clone() for f in describe_local_state(engine, naming)}
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"frags": frags, "params": params, "scalars": optimizer_scalars(engine),
            "steps": (engine.global_steps, engine.global_samples, engine.skipped_steps)}


def _wipe(engine, naming):
    from deepspeed_ext.state import describe_local_state
    with torch.no_grad():
        for f in describe_local_state(engine, naming):
            f.tensor.fill_(float("nan"))
        for p in engine.module.parameters():
            p.fill_(float("nan"))


def _same(a, b):
    return (a["steps"] == b["steps"] and a["scalars"] == b["scalars"]
            and a["frags"].keys() == b["frags"].keys()
            and all(torch.equal(a["frags"][k], b["frags"][k]) for k in a["frags"])
            and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]))


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    import deepspeed
    from megatron.training import jit_ops
    jit_ops.disable_unused_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed_ext.exact import survivor
    from deepspeed_ext.exact.cross_stage import CrossStageLog
    from deepspeed_ext.exact.operators import OperatorIndex
    from deepspeed_ext.exact.local_replay import StageReplay, gather_replay_inputs
    from deepspeed_ext.exact.upstream import UpstreamLog
    from deepspeed_ext.runtime.groups import init_metadata_group, metadata_group
    from deepspeed_ext.state import expert_naming
    from megatron.model.config import GPTMoEConfig
    from megatron.model.gpt_moe_pipe import build_pipe_model
    init_metadata_group()
    config = GPTMoEConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                          max_position_embeddings=SEQ, num_experts=4, moe_expert_parallel_size=2,
                          expert_interval=1, topk=1, hidden_dropout=0.0, attention_dropout=0.0)
    rank = dist.get_rank()
    module = build_pipe_model(config, 2, rank % 2)
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
        config={"train_batch_size": MICRO_BATCH * MICRO * 2, "train_micro_batch_size_per_gpu": MICRO_BATCH,
                "gradient_accumulation_steps": MICRO, "gradient_clipping": 0.05,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 6})
    naming = expert_naming(engine.module)
    index = OperatorIndex(engine, naming)
    stage, dp_rank = engine.stage_id, engine.grid.get_data_parallel_id()
    upstream = UpstreamLog(engine, retain_iterations=4)
    upstream.attach()
    cross = CrossStageLog(engine, 4)
    cross.attach()
    saved, results, losses = {}, [], []
    for failed, (start, end) in ((1, (2, 4)), (0, (4, 6))):
        # the state of step `start`, as a survivor of an in-job restart keeps it
        if engine.global_steps == start:
            saved[start] = survivor.capture(engine, naming, survivor.mark(engine))
        while engine.global_steps < end:
            losses.append(engine.train_batch(_batches(engine.global_steps + 1, end, dp_rank)).item())
            cross.end_step()
            if engine.global_steps == start:
                saved[start] = survivor.capture(engine, naming, survivor.mark(engine))
        replayed = list(range(start + 1, end + 1))
        if stage == failed:  # the failure: this stage's state and logs are gone
            before = _capture(engine, naming)
            sent = {k: v for k, v in upstream.entries.items() if k.iteration in replayed}
            _wipe(engine, naming)
            upstream.clear()
            cross.clear()
        else:  # the logs through a survivor's new engine (in-job): kept, then adopted
            kept = survivor.capture(engine, naming, survivor.mark(engine), upstream, cross)
            upstream.clear()
            cross.clear()
            survivor.adopt_logs(kept, upstream, cross)
        inputs = gather_replay_inputs(engine, failed, replayed, upstream, cross)
        if stage == failed:
            misfit = survivor.misfit(engine, index, saved[start])
            empty = survivor.misfit(engine, index, survivor.SurvivorState({}, {}))
            survivor.restore(engine, index, saved[start])  # the stage's all-gather
            replay = StageReplay(engine, upstream, cross, inputs)
            data = _batches(start + 1, end, dp_rank)
            steps = [replay.step(data) for _ in replayed]
            resent = {k: v for k, v in upstream.entries.items() if k.iteration in replayed}
            results.append({"failed": failed, "steps": steps, "misfit": misfit, "misfit_empty": empty,
                            "same_state": _same(before, _capture(engine, naming)),
                            "same_sends": sent.keys() == resent.keys() and all(
                                all(torch.equal(a, b) for a, b in zip(sent[k], resent[k])) for k in sent),
                            "sends": len(sent), "collectives": len(inputs.collectives)})
        dist.barrier(group=metadata_group())  # the survivors wait here
    losses.append(engine.train_batch(_batches(7, 8, dp_rank)).item())
    cross.end_step()
    held = [(k.iteration, k.micro_batch, k.direction) for k in sorted(
        upstream.entries, key=lambda k: (k.iteration, k.micro_batch))]
    entry_bytes = sorted({sum(t.numel() * t.element_size() for t in v) for v in upstream.entries.values()})
    engine.eval_batch(_batches(8, 8, dp_rank))  # evaluation's sends are not kept
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"stage": stage, "results": results, "losses": losses, "held": held,
                   "held_after_eval": len(upstream.entries), "bytes": upstream.bytes,
                   "entry_bytes": entry_bytes, "cross_steps": sorted({s for s, _ in cross.entries})}, f)


if __name__ == "__main__":
    main()
