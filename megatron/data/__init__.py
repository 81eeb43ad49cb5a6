"""Data pipeline for GPT-MoE pretraining: tokenizers, datasets and samplers.

Public names are re-exported lazily (importing ``megatron.data`` alone does not import
megatron.core, which takes seconds):

* :func:`build_tokenizer`, :data:`TOKENIZER_TYPES`, :class:`Tokenizer`
  (``megatron.data.tokenizer``)
* :func:`build_train_valid_test_datasets`, :func:`parse_data_path`,
  :func:`parse_split`, :func:`get_split_sizes` (``megatron.data.gpt_dataset``)
* :class:`PretrainingSampler`, :func:`build_pretraining_data_loader`,
  :func:`collate_pretraining_batch` (``megatron.data.samplers``)
"""

import importlib

_EXPORTS = {
    "build_tokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "TOKENIZER_TYPES": "tokenizer",
    "build_train_valid_test_datasets": "gpt_dataset",
    "parse_data_path": "gpt_dataset",
    "parse_split": "gpt_dataset",
    "get_split_sizes": "gpt_dataset",
    "PretrainingSampler": "samplers",
    "build_pretraining_data_loader": "samplers",
    "collate_pretraining_batch": "samplers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
