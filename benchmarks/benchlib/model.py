"""The benchmarks' model: ONE GPT-MoE DeepSpeed engine built from the trainer's own
arguments (:func:`build_engine`), trained on synthetic tokens (:func:`synthetic_batch`)."""

import sys

from benchlib.ranks import REPO

VOCAB = 257  # the byte-level tokenizer's vocabulary; tokens are synthetic anyway


def _trainer_argv(opts) -> list:
    """The trainer's flags for this benchmark's model (parsed by megatron's own parser)."""
    argv = ["--num-layers", opts.num_layers, "--hidden-size", opts.hidden_size,
            "--ffn-hidden-size", opts.ffn_hidden_size,
            "--num-attention-heads", opts.num_attention_heads, "--seq-length", opts.seq_length,
            "--max-position-embeddings", opts.seq_length, "--make-vocab-size-divisible-by", 128,
            "--num-experts", opts.num_experts, "--moe-expert-parallel-size", opts.ep,
            "--expert-interval", opts.expert_interval, "--topk", opts.topk,
            "--micro-batch-size", opts.micro_batch_size, "--train-iters", max(opts.train_steps, 1),
            "--lr", 1e-3, "--lr-warmup-iters", 0, "--zero-stage", opts.zero_stage,
            "--hidden-dropout", 0, "--attention-dropout", 0, "--seed", opts.seed,
            "--data-path", "unused", "--log-interval", 1, "--eval-iters", 0]
    tp = getattr(opts, "tp", 1)
    if tp > 1:  # the tensor-parallel layout (experts sharded as Megatron-DeepSpeed does)
        argv += ["--tensor-model-parallel-size", tp, "--enable-expert-tensor-parallelism"]
    return [str(a) for a in argv]


def synthetic_batch(args, step: int, micro: int, rank: int):
    """(tokens, positions, labels) of micro-batch ``micro`` of step ``step`` on ``rank``:
    random tokens, the same for the same arguments (every benchmark's training loop), and
    the same on the ranks of one tensor-parallel group (ranks are tensor-parallel
    innermost: the data-parallel rank is ``rank // T``)."""
    import torch
    data_rank = rank // getattr(args, "tensor_model_parallel_size", 1)
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + data_rank)
    tokens = torch.randint(0, VOCAB, (args.micro_batch_size, args.seq_length + 1), generator=gen)
    positions = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
    return tokens[:, :-1], positions, tokens[:, 1:]


def _train(engine, args, steps: int, rank: int) -> list:
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().current_device_name()
    losses = []
    for step in range(steps):
        for micro in range(args.gradient_accumulation_steps):
            tokens, positions, labels = (t.to(device) for t in synthetic_batch(args, step, micro, rank))
            lm_loss, aux_loss, _ = engine(tokens, positions, labels)
            engine.backward(lm_loss + args.moe_loss_coeff * aux_loss)
            engine.step()
        losses.append(float(lm_loss.item()))
    return losses


def _param_counts(engine, world: int, ep: int, tp: int) -> dict:
    """Parameters of the whole model: expert (DeepSpeed marks them allreduce=False) and not;
    a tensor-parallel part counted as its whole tensor."""
    import math
    import torch
    import torch.distributed as dist
    from deepspeed_ext.state import global_shape
    expert = sum(math.prod(global_shape(p, tp)) for p in engine.module.parameters()
                 if not getattr(p, "allreduce", True))
    dense = sum(math.prod(global_shape(p, tp)) for p in engine.module.parameters()
                if getattr(p, "allreduce", True))
    from deepspeed_ext.runtime.groups import metadata_group
    total_expert = torch.tensor([expert], dtype=torch.int64)
    dist.all_reduce(total_expert, group=metadata_group())  # a CPU tensor: never on NCCL
    # each expert lives on world/ep ranks (its data-parallel replicas x its tensor parts)
    expert_all = int(total_expert.item()) // (world // ep)
    return {"params_total": expert_all + dense, "params_expert": expert_all,
            "params_non_expert": dense,
            "expert_fraction": expert_all / max(1, expert_all + dense)}


def build_engine(opts, rank: int, world: int) -> tuple:
    """Every rank: the benchmark's engine, trained ``--train-steps`` steps so Adam state
    exists. Returns (engine, args, the results' config record)."""
    sys.path.insert(0, REPO)
    from megatron.training.arguments import padded_vocab_size, parse_args, validate_args
    from deepspeed_ext.engine.rng import set_seed
    from megatron.training.training import initialize_distributed, setup_model_and_optimizer
    args = parse_args(_trainer_argv(opts))
    validate_args(args, world)
    initialize_distributed(args)
    set_seed(args.seed)
    args.padded_vocab_size = padded_vocab_size(VOCAB, args.make_vocab_size_divisible_by)
    engine, _ = setup_model_and_optimizer(args)
    losses = _train(engine, args, opts.train_steps, rank)
    num_moe_layers = len([l for l in range(1, args.num_layers + 1) if l % args.expert_interval == 0])
    config = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
              "ffn_hidden_size": args.ffn_hidden_size or 4 * args.hidden_size,
              "num_attention_heads": args.num_attention_heads, "seq_length": args.seq_length,
              "num_experts": args.num_experts, "expert_interval": args.expert_interval,
              "num_moe_layers": num_moe_layers, "topk": args.topk,
              "padded_vocab_size": args.padded_vocab_size, "dtype": "fp32",
              "world_size": world, "ep_size": opts.ep, "dp_size": world // args.tensor_model_parallel_size,
              "tp_size": args.tensor_model_parallel_size,
              "zero_stage": opts.zero_stage, "micro_batch_size": args.micro_batch_size,
              "train_steps": opts.train_steps, "train_losses": losses,
              **_param_counts(engine, world, opts.ep, args.tensor_model_parallel_size)}
    return engine, args, config
