"""The trainer's flags checked on the launching machine, before a cluster launch.

``scripts/launch_cluster.sh`` runs ``python -m megatron.training.launch_check CONFIG
DATA_PATH EP [flags...]`` once, before it calls the ``deepspeed`` launcher: a flag the
trainer refuses, or a GPT-2 BPE tokenizer without its files, would otherwise stop every
rank of every node only after the launch (configs/gpt-125m-8e.yaml selects GPT-2 BPE, and
the README's commands once gave it no files). Nothing here imports torch or DeepSpeed.
Exit status 0 when the flags pass, 2 with ``error: ...`` on stderr when they do not.
"""

import os
import sys
from typing import List, Optional, Sequence

import yaml

from megatron.errors import ConfigError
from megatron.training.arguments import parse_args
from megatron.training.megatron_compat import infer_tokenizer

GPT2_FILES = (("--vocab-file", "vocab_file", "vocab.json"),
              ("--merge-file", "merge_file", "merges.txt"))
"""GPT-2 BPE's files: (flag, argument name, GPT-2's own file name)."""


def _configs_naming_gpt2(configs: Sequence[str]) -> List[str]:
    """The YAML files among ``configs`` that set ``tokenizer-type: GPT2BPETokenizer``."""
    named = []
    for path in configs:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
        if "GPT2BPETokenizer" in (values.get("tokenizer-type"), values.get("tokenizer_type")):
            named.append(path)
    return named


def launch_problem(config: str, data_path: str, ep: str, extra: Sequence[str]) -> Optional[str]:
    """What stops the launch of ``pretrain_gpt_moe.py --config CONFIG --data-path DATA_PATH
    --moe-expert-parallel-size EP EXTRA...``, or None when its flags pass.

    The flags are validated as the trainer validates them at one rank (the world size is
    the launch's, which this machine does not know); the tokenizer files must exist here,
    where the repository and its files sit at the same paths as on every node.
    """
    try:
        args = parse_args(["--config", config, "--data-path", data_path,
                           "--moe-expert-parallel-size", ep, *extra])
        infer_tokenizer(args)
    except ConfigError as e:
        return str(e)
    if args.tokenizer_type != "GPT2BPETokenizer":
        return None
    missing = [(flag, name) for flag, attr, name in GPT2_FILES if not getattr(args, attr)]
    if missing:  # say what chose GPT-2 BPE: the flag, a config, or the other file's flag
        configs = [config] + [v for k, v in zip(extra, extra[1:]) if k == "--config"]
        named = _configs_naming_gpt2(configs)
        given = [flag for flag, attr, _ in GPT2_FILES if getattr(args, attr)]
        source = ("--tokenizer-type GPT2BPETokenizer" if "--tokenizer-type" in extra
                  else f"{named[-1]} uses GPT2BPETokenizer" if named
                  else f"{given[0]} selects GPT2BPETokenizer")
        return (f"{source}: pass {' and '.join(flag for flag, _ in missing)} "
                f"(GPT-2's {' and '.join(name for _, name in missing)})")
    for flag, attr, _ in GPT2_FILES:
        if not os.path.isfile(getattr(args, attr)):
            return f"{flag} {getattr(args, attr)}: file not found"
    return None


def main(argv: Sequence[str]) -> int:
    """``CONFIG DATA_PATH EP [flags...]``: 0 when the flags pass, else 2 with the reason."""
    if len(argv) < 3:
        print("usage: python -m megatron.training.launch_check CONFIG DATA_PATH EP [flags...]",
              file=sys.stderr)
        return 2
    problem = launch_problem(argv[0], argv[1], argv[2], list(argv[3:]))
    if problem is None:
        return 0
    print(f"error: {problem}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
