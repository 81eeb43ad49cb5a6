"""``--config FILE.yaml``: a YAML file of flag names and values, turned into the flags it
stands for.

Keys are the flag names without dashes (``num-layers`` or ``num_layers``); a nested
section is flattened with its name as prefix, so ``moc: {pec-k: 1}`` means
``--moc-pec-k 1``. :func:`megatron.training.arguments.parse_args` puts the files' flags
before the command line's, so the command line wins.
"""

import argparse
from typing import Dict, List

from megatron.errors import ConfigError


def flatten(mapping: Dict, prefix: str = "") -> Dict[str, object]:
    """Nested sections as flat keys: ``{"moc": {"pec_k": 1}}`` -> ``{"moc-pec-k": 1}``."""
    out = {}
    for key, value in mapping.items():
        name = f"{prefix}{str(key).replace('_', '-')}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "-"))
        else:
            out[name] = value
    return out


def yaml_to_argv(path: str, parser: argparse.ArgumentParser) -> List[str]:
    """Turn a YAML config into the flags it stands for.

    Raises:
        ConfigError: the file is missing or not a mapping, or has a key that is no flag.
    """
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of flag names to values")
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    argv: List[str] = []
    for key, value in flatten(data).items():
        flag = f"--{key}"
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise ConfigError(f"unknown key '{key}' in {path} (no flag {flag})")
        # A switch (``swiglu: true``; ``disable-bias-linear: true`` for a store_false one):
        # the flag when true, nothing when false.
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ConfigError(f"key '{key}' in {path} must be true or false, got {value!r}")
            if value:
                argv.append(flag)
        elif value is None:
            continue
        elif isinstance(value, list):
            argv += [flag] + [str(v) for v in value]
        else:
            argv += [flag, str(value)]
    return argv
