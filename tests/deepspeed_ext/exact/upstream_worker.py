"""A rank of the upstream-log test: a 2-stage GPT-MoE pipeline on 2 ranks (one per
stage), 3 ZeRO-1 steps of 4 micro-batches (more than the stages' 2 and 1 pipeline
buffers, which the engine therefore reuses) and one evaluation batch, with an
:class:`~deepspeed_ext.exact.upstream.UpstreamLog` that keeps 2 steps on each stage, and a
spy on what each stage received. Writes OUT_DIR/rank<R>.json: the log's keys and bytes,
and whether every logged send equals, bit for bit, what the other stage received.

    upstream_worker.py OUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS, MICRO, MICRO_BATCH, SEQ, VOCAB = 3, 4, 2, 16, 64


def _batches(steps):
    for step in range(steps):
        for micro in range(MICRO):
            gen = torch.Generator().manual_seed(1000 * step + micro)
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
            positions = torch.arange(SEQ).expand(MICRO_BATCH, -1).contiguous()
            yield ((tokens[:, :-1].contiguous(), positions),
                   (tokens[:, 1:].contiguous(), torch.ones(MICRO_BATCH, SEQ)))


def _spy_receives(engine, received):
    """Record, per step and micro-batch, what the engine received (the test's own view)."""
    from deepspeed.runtime.pipe import schedule
    table = dict(engine._INSTRUCTION_MAP)
    recv_act, recv_grad = table[schedule.RecvActivation], table[schedule.RecvGrad]
    counts = {}

    def on_act(eng, buffer_id):
        recv_act(eng, buffer_id)
        if not eng.module.training:
            return  # evaluation's
        key = ("activation", eng.global_steps + 1)
        n = counts[key] = counts.get(key, -1) + 1
        received[(key[1], n, key[0])] = [t.detach().clone() for t in eng.pipe_buffers["inputs"][buffer_id]
                                         if torch.is_tensor(t)]

    def on_grad(eng, buffer_id):
        recv_grad(eng, buffer_id)
        if not eng.module.training:
            return
        key = ("gradient", eng.global_steps + 1)
        n = counts[key] = counts.get(key, -1) + 1
        received[(key[1], n, key[0])] = [t.detach().clone() for t in eng.grad_layer]

    table[schedule.RecvActivation], table[schedule.RecvGrad] = on_act, on_grad
    engine._INSTRUCTION_MAP = table


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    import deepspeed
    from megatron.training import jit_ops
    jit_ops.disable_unused_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed_ext.exact.upstream import UpstreamLog
    from megatron.model.config import GPTMoEConfig
    from megatron.model.gpt_moe_pipe import build_pipe_model
    config = GPTMoEConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                          max_position_embeddings=SEQ, num_experts=2, moe_expert_parallel_size=1,
                          expert_interval=1, topk=1, hidden_dropout=0.0, attention_dropout=0.0)
    module = build_pipe_model(config, 2, 0)
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
        config={"train_batch_size": MICRO_BATCH * MICRO, "train_micro_batch_size_per_gpu": MICRO_BATCH,
                "gradient_accumulation_steps": MICRO,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 6})
    log = UpstreamLog(engine, retain_iterations=2)
    log.attach()
    received = {}
    _spy_receives(engine, received)
    data = _batches(STEPS + 1)
    for _ in range(STEPS):
        engine.train_batch(data)
    before_eval = sorted((k.iteration, k.micro_batch, k.direction) for k in log.entries)
    engine.eval_batch(data)
    rank = dist.get_rank()
    # each stage checks the other's log against what it received
    logged = {(k.iteration, k.micro_batch, k.direction): [t for t in v] for k, v in log.entries.items()}
    theirs = [None, None]
    dist.all_gather_object(theirs, logged)
    other = theirs[1 - rank]
    matched = [key for key, tensors in other.items()
               if key in received and len(tensors) == len(received[key])
               and all(torch.equal(a, b) for a, b in zip(tensors, received[key]))]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"keys": before_eval,
                   "after_eval": sorted((k.iteration, k.micro_batch, k.direction) for k in log.entries),
                   "bytes": log.bytes, "peak": log.peak_bytes,
                   "entry_bytes": sorted({sum(t.numel() * t.element_size() for t in v)
                                          for v in log.entries.values()}),
                   "other_logged": len(other), "matched": len(matched),
                   "received_steps": sorted({k[0] for k in received})}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
