"""Peak memory of one training step of the GPT-MoE model with and without
``--checkpoint-activations``, on CPU.

Each mode runs in its own process (a one-rank gloo group, as DeepSpeed's MoE layer needs):
build the model, run one forward and backward pass on random tokens, and report

* ``saved for backward``: the bytes of the distinct tensors autograd keeps from the
  forward pass for the backward pass (``torch.autograd.graph.saved_tensors_hooks``),
  the activation memory the recompute is about;
* ``peak RSS growth``: the process's peak resident memory (``ru_maxrss``) after the step
  minus its resident memory before it, what the machine saw (the children run with
  ``MALLOC_MMAP_THRESHOLD_=131072``, so that memory freed during the backward pass
  leaves the process instead of staying in glibc's heap).

Usage: ``python benchmarks/activation_checkpointing_memory.py [--layers 8 --hidden 256
--seq 512 --batch 8]``; prints a Markdown table (docs/megatron-deepspeed.md has one run).
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(opts: argparse.Namespace, checkpoint: bool) -> dict:
    """One step in this process; the figures of the module docstring."""
    sys.path.insert(0, REPO)
    import torch
    import deepspeed
    from megatron.model.config import GPTMoEConfig
    from megatron.model.gpt_moe import GPTMoEModel
    from megatron.training import jit_ops
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    jit_ops.disable_unused_ops()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    config = GPTMoEConfig(num_layers=opts.layers, hidden_size=opts.hidden,
                          num_attention_heads=opts.heads, vocab_size=opts.vocab,
                          max_position_embeddings=opts.seq, num_experts=opts.experts, topk=1,
                          checkpoint_activations=checkpoint)
    model = GPTMoEModel(config)
    for layer in model.layers:
        if layer.is_moe:
            layer.mlp.set_deepspeed_parallelism()
    model.train()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, opts.vocab, (opts.batch, opts.seq), generator=gen)
    positions = torch.arange(opts.seq).expand(opts.batch, opts.seq)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)  # the same dropout masks in both modes
    rss_before = _rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss, aux, _ = model(tokens, positions, tokens.roll(-1, 1))
    saved_bytes = sum(saved.values())
    (lm_loss + 0.01 * aux).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"checkpoint": checkpoint, "saved_bytes": saved_bytes,
            "peak_growth_bytes": peak - rss_before, "loss": float(lm_loss)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # a child's mode
    opts = p.parse_args(argv)
    if opts.one:
        print(json.dumps(measure(opts, opts.one == "on")))
        return
    rows = []
    for mode in ("off", "on"):
        child = [a for a in (argv if argv is not None else sys.argv[1:])]
        out = subprocess.run([sys.executable, os.path.abspath(__file__), *child, "--one", mode],
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                                      # Large blocks mmap'd, so freeing them returns them
                                      # (glibc's dynamic threshold kept freed activations
                                      # resident and the RSS measured the allocator).
                                      MALLOC_MMAP_THRESHOLD_="131072"))
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = 1024.0 ** 2
    print(f"model: {opts.layers} layers, hidden {opts.hidden}, {opts.heads} heads, "
          f"{opts.experts} experts every 2nd layer; batch {opts.batch} x {opts.seq} tokens; "
          "fp32, CPU, one rank")
    print("| --checkpoint-activations | saved for backward (MiB) | peak RSS growth (MiB) | loss |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {'on' if row['checkpoint'] else 'off'} | {row['saved_bytes'] / mib:.1f} | "
              f"{row['peak_growth_bytes'] / mib:.1f} | {row['loss']:.6f} |")
    off, on = rows
    print(f"saving: {100 * (1 - on['saved_bytes'] / off['saved_bytes']):.0f} % of the saved "
          f"activations, {100 * (1 - on['peak_growth_bytes'] / off['peak_growth_bytes']):.0f} % "
          "of the peak growth")


if __name__ == "__main__":
    main()
