"""A rank of the pipeline test: the GPT-MoE model (2 layers, the second MoE with 4
experts, expert parallelism 2) trained 3 ZeRO-1 steps of 2 micro-batches by DeepSpeed,
either whole (``1``: 2 ranks, data-parallel 2) or as a 2-stage ``PipelineModule``
(``2``: 4 ranks, 2 per stage; or LAYERS layers and expert parallelism EP, any number of
stages), on the same micro-batches per data-parallel rank; writes
OUT_DIR/rank<R>.json with each step's loss (averaged over micro-batches and data-parallel
ranks, as the pipeline engine reports it).

    pipe_worker.py OUT_DIR STAGES TOPK EXPERT_INTERVAL [LAYERS EP]
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS, MICRO, MICRO_BATCH, SEQ, VOCAB = 3, 2, 2, 16, 64


def _batch(step, micro, dp_rank):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(MICRO_BATCH, -1).contiguous()
    return tokens[:, :-1].contiguous(), positions, tokens[:, 1:].contiguous(), torch.ones(MICRO_BATCH, SEQ)


def _ds_config(dp):
    return {"train_batch_size": MICRO_BATCH * MICRO * dp, "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": MICRO, "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 6}


def main():
    out_dir, stages, topk, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    layers, ep = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (2, 2)
    dist.init_process_group("gloo")
    import deepspeed
    from megatron.training import jit_ops
    # as the trainer: no JIT build of DeepSpeed's shm op (a cold build held the ranks
    # 25-35 s, and every checkout of a venv rebuilt it)
    jit_ops.disable_unused_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron.model.config import GPTMoEConfig
    config = GPTMoEConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                          max_position_embeddings=SEQ, num_experts=4, moe_expert_parallel_size=ep,
                          expert_interval=interval, topk=topk, hidden_dropout=0.0, attention_dropout=0.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // stages
    dp_rank, ep_rank = rank % dp, rank % ep
    losses = []
    if stages == 1:
        from megatron.model.gpt_moe import GPTMoEModel
        model = GPTMoEModel(config, ep_rank=ep_rank)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_ds_config(dp))
        torch.manual_seed(1234)
        for step in range(STEPS):
            total = 0.0
            for micro in range(MICRO):
                tokens, positions, labels, mask = _batch(step, micro, dp_rank)
                lm, aux, _ = engine(tokens, positions, labels, mask)
                loss = lm + config.moe_loss_coeff * aux
                engine.backward(loss)
                engine.step()
                total += loss.item()
            mean = torch.tensor([total / MICRO])
            dist.all_reduce(mean)
            losses.append(mean.item() / dp)
    else:
        from megatron.model.gpt_moe_pipe import build_pipe_model
        module = build_pipe_model(config, stages, ep_rank)
        engine, _, _, _ = deepspeed.initialize(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
            config=_ds_config(dp))

        def batches():
            for step in range(STEPS):
                for micro in range(MICRO):
                    tokens, positions, labels, mask = _batch(step, micro, dp_rank)
                    yield (tokens, positions), (labels, mask)
        data = batches()
        torch.manual_seed(1234)
        for step in range(STEPS):
            losses.append(float(engine.train_batch(data)))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "stage": rank // dp}, f)
    dist.barrier()
    dist.destroy_process_group()
    from megatron.training.exit import exit_without_teardown
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
