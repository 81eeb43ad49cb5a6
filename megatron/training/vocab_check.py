"""Whether a checkpoint's vocabulary rows fit this run's: the padded vocabulary follows
the tensor-parallel size (``--make-vocab-size-divisible-by`` x T), so one model has other
padding rows at another T. Pure functions of the saved and current arguments;
:func:`megatron.training.checkpointing.check_compatible` raises what they return."""

import argparse
from typing import Dict, Optional

from megatron.training.arguments import padded_vocab_size


def vocab_refusal(saved: Dict, args: argparse.Namespace, reshards: bool) -> str:
    """Why a checkpoint saved with the arguments ``saved`` cannot be loaded by this run
    for its vocabulary; '' when it can. Pure (:func:`check_compatible` calls it on every
    rank with the same input; tests call it directly).

    The padded vocabulary follows the tensor-parallel size (``--make-vocab-size-divisible-by``
    x T). A MoC checkpoint (``reshards``) that records the same tokenizer vocabulary as
    this run's loads under another padding: the library trims or adds padding rows
    (:mod:`deepspeed_ext.format.vocab`). A DeepSpeed-format one loads only with its own
    padding, and so does a checkpoint that records no vocabulary size (saved before it
    was recorded); the message then names the ``--make-vocab-size-divisible-by`` that
    pads this run's vocabulary to the saved rows, when one does.
    """
    saved_rows, rows = saved.get("padded_vocab_size"), getattr(args, "padded_vocab_size", None)
    if saved_rows is None or saved_rows == rows:
        return ""
    real, saved_real = getattr(args, "true_vocab_size", None), saved.get("true_vocab_size")
    if real is not None and saved_real is not None and real != saved_real:
        return (f"was saved with a vocabulary of {saved_real} tokens ({_tokenizer_flags(saved)}), "
                f"this run's has {real} ({_tokenizer_flags(vars(args))}): only padding rows can "
                f"be trimmed or added, so load it with the tokenizer it was saved with, or use "
                f"another --load directory")
    if reshards and real is not None and saved_real is not None:
        return ""  # the same tokens: MoC trims or adds padding rows
    tp = getattr(args, "tensor_model_parallel_size", 1)
    why = ("it records no tokenizer vocabulary size (saved before it was recorded), so its "
           "padding rows cannot be told from its tokens" if saved_real is None else
           "DeepSpeed's checkpoints load only with their own padding (MoC checkpoints trim "
           "or add padding rows)" if not reshards else
           "this run does not know its tokenizer's vocabulary size")
    return (f"was saved with its vocabulary padded to {saved_rows} rows "
            f"({_padding_flags(saved)}), this run pads it to {rows} "
            f"({_padding_flags(vars(args))}); {why}: "
            + _padding_hint(saved, real or saved_real, saved_rows, tp))


def _tokenizer_flags(values: Dict) -> str:
    """The tokenizer flags of saved or current arguments, as a user would type them."""
    flags = [f"--tokenizer-type {values.get('tokenizer_type')}"]
    for name in ("vocab_file", "merge_file"):
        if values.get(name):
            flags.append(f"--{name.replace('_', '-')} {values[name]}")
    return " ".join(flags)


def _padding_flags(values: Dict) -> str:
    return (f"--make-vocab-size-divisible-by {values.get('make_vocab_size_divisible_by')} x "
            f"--tensor-model-parallel-size {values.get('tensor_model_parallel_size', 1)}")


def _padding_hint(saved: Dict, vocab: Optional[int], saved_rows: int, tp: int) -> str:
    """What to add to this run's flags for the padding ``saved_rows`` at ``tp``."""
    divisor = matching_divisor(vocab, saved_rows, tp, saved.get("make_vocab_size_divisible_by"),
                               saved.get("tensor_model_parallel_size", 1))
    if divisor is None:
        return (f"no --make-vocab-size-divisible-by pads this run's vocabulary to {saved_rows} "
                f"rows at --tensor-model-parallel-size {tp}; use another --load directory")
    return (f"add --make-vocab-size-divisible-by {divisor}, which pads this run's vocabulary "
            f"to {saved_rows} rows at --tensor-model-parallel-size {tp}, or use another --load "
            f"directory")


def matching_divisor(vocab: Optional[int], padded: int, tp: int,
                     saved_divisor: Optional[int] = None, saved_tp: int = 1) -> Optional[int]:
    """A ``--make-vocab-size-divisible-by`` that pads ``vocab`` tokens to ``padded`` rows at
    tensor-parallel size ``tp``: the saving run's multiple over ``tp`` when it does
    (``saved_divisor`` x ``saved_tp`` / ``tp``), else the smallest that does; None when
    none does (or ``vocab`` is unknown)."""
    if not vocab or not padded or tp < 1:
        return None
    if saved_divisor and (saved_divisor * saved_tp) % tp == 0:
        preferred = saved_divisor * saved_tp // tp
        if padded_vocab_size(vocab, preferred, tp) == padded:
            return preferred
    fits = [d for d in range(1, padded // tp + 1)
            if padded % (d * tp) == 0 and padded_vocab_size(vocab, d, tp) == padded]
    return min(fits) if fits else None
