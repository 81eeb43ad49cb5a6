"""Printing a benchmark's results: aligned tables, numbers or ``-``, the model's lines."""


def fmt(value, spec: str, scale: float = 1.0) -> str:
    """``value / scale`` formatted with ``spec``; ``-`` for None (a failed or absent figure)."""
    return "-" if value is None else format(value / scale, spec)


def print_aligned(table: list) -> None:
    """Print rows of strings as columns; the first row is the header."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print(" | ".join(cell.ljust(w) if j == 0 else cell.rjust(w)
                         for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def print_model(config: dict, layout_extra: str = "") -> None:
    """The model, parameter and layout lines of a results config (nothing if empty)."""
    if not config:
        return
    print(f"model:   {config['num_layers']} layers, hidden {config['hidden_size']}, ffn "
          f"{config['ffn_hidden_size']}, {config['num_attention_heads']} heads, seq "
          f"{config['seq_length']}, vocab {config['padded_vocab_size']}, {config['num_experts']} "
          f"experts per MoE layer, MoE every {config['expert_interval']} layers "
          f"({config['num_moe_layers']} MoE layers), top-{config['topk']}, {config['dtype']}")
    print(f"params:  {config['params_total'] / 1e6:.2f} M: expert {config['params_expert'] / 1e6:.2f} M "
          f"({100 * config['expert_fraction']:.1f} %), non-expert {config['params_non_expert'] / 1e6:.2f} M")
    tp = f"TP {config['tp_size']}, " if config.get("tp_size", 1) > 1 else ""
    print(f"layout:  {config['world_size']} ranks, {tp}EP {config['ep_size']}, DP {config['dp_size']}, "
          f"ZeRO-{config['zero_stage']}{layout_extra}")
