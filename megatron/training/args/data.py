"""Flags of the training data and tokenizer, and the check that they name one source.

The check runs on every rank in :func:`megatron.training.arguments.validate_args`.
"""

import argparse

from megatron.errors import ConfigError


def add_data_args(p: argparse.ArgumentParser) -> None:
    """The ``data`` group: datasets (one blend split three ways, or three), tokenizer."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+",
                   help="Indexed dataset prefix, or 'w1 prefix1 w2 prefix2 ...' for a blend "
                        "(required, unless --train-data-path is given).")
    g.add_argument("--split", default="969,30,1",
                   help="Train,valid,test proportions of the --data-path documents.")
    for name, use in (("train", "training set, instead of --data-path and --split"),
                      ("valid", "validation set, with --train-data-path (else none)"),
                      ("test", "test set, with --train-data-path (else none)")):
        g.add_argument(f"--{name}-data-path", nargs="+",
                       help=f"The {use}: a prefix or a weighted blend as for --data-path, each "
                            "dataset used whole (Megatron-DeepSpeed's separate datasets).")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer",
                   help="ByteLevelTokenizer, or GPT2BPETokenizer with --vocab-file and --merge-file.")
    g.add_argument("--vocab-file", help="Tokenizer vocabulary file (GPT-2 vocab.json); without "
                                        "--tokenizer-type it selects GPT2BPETokenizer.")
    g.add_argument("--merge-file", help="BPE merges file (GPT-2 merges.txt); without "
                                        "--tokenizer-type it selects GPT2BPETokenizer.")
    g.add_argument("--data-cache-path", help="Where dataset index caches are written.")
    g.add_argument("--num-workers", type=int, default=0, help="Data loader worker processes.")


def check_data_paths(args: argparse.Namespace) -> None:
    """One source of data: --data-path (carved by --split), or Megatron-DeepSpeed's
    separate --train-data-path/--valid-data-path/--test-data-path."""
    separate = [f"--{name}-data-path" for name in ("train", "valid", "test")
                if getattr(args, f"{name}_data_path", None)]
    if args.data_path is None and not separate:
        raise ConfigError("--data-path is required (a flag, or the key 'data-path' in "
                          "--config), or --train-data-path for separate datasets")
    if args.data_path is not None and separate:
        raise ConfigError(f"--data-path and {'/'.join(separate)} both name the data: give "
                          "--data-path (split by --split) or separate datasets, not both")
    if separate and "--train-data-path" not in separate:
        raise ConfigError(f"{'/'.join(separate)} needs --train-data-path (the training set)")
