"""The trainer's answer to ``moc-plan``: the shape of the model a training YAML config
describes (parameter counts, experts, MoE layers, tokens per iteration), read with this
trainer's own parser and parameter count.

``moc-plan`` (:mod:`deepspeed_ext.planning.cli`, which defines the exchange) runs this
project's ``pretrain_gpt_moe.py --model-shape`` with one JSON request on stdin; the entry
point calls :func:`answer`, which writes one JSON answer on stdout and returns the exit
status. The planner so calls a program instead of importing the trainer.

- request: ``{"config": str, "ep": int, "gpus": int}`` (``ep`` 0: the config's expert
  parallelism; ``gpus`` 0: the batch is not checked against a data-parallel size);
- answer, one line: exit status 0 and the fields of the planner's own
  :class:`deepspeed_ext.planning.inputs.ModelShape`, or exit status 2
  and ``{"error": str}``, a message naming the flag and the file to fix.
"""

import os
from dataclasses import asdict, dataclass
from typing import Optional, TextIO

from deepspeed_ext.planning.inputs import ModelShape
from megatron.errors import ConfigError
from megatron.training.entry_requests import answer_request, request_object

VOCAB = {"GPT2BPETokenizer": 50257, "ByteLevelTokenizer": 257}
"""The tokenizers' vocabulary sizes, before padding (no tokenizer file is read: the
planner needs only the embedding's size); any other: GPT-2's."""


@dataclass(frozen=True)
class ShapeRequest:
    """What the planner asks (one JSON object on stdin), checked by :meth:`from_json`."""

    config: str
    """The training YAML config (relative: from the current directory)."""
    ep: int
    """Expert-parallel size to use instead of the config's; 0: the config's."""
    gpus: int
    """The data-parallel size (every rank); 0: not checked."""

    @classmethod
    def from_json(cls, text: str) -> "ShapeRequest":
        """The request in ``text``.

        Raises:
            ConfigError: not a JSON object with these fields of these types.
        """
        data = request_object(text)
        if not (isinstance(data, dict) and isinstance(data.get("config"), str)
                and all(type(data.get(k)) is int and data[k] >= 0 for k in ("ep", "gpus"))):
            raise ConfigError("the request on stdin is not a model-shape request (moc-plan "
                              "writes those)")
        return cls(data["config"], data["ep"], data["gpus"])


def model_shape(path: str, ep_override: int = 0, gpus: int = 0) -> ModelShape:
    """The model of the training YAML config ``path`` (:func:`answer` calls it).

    Raises:
        ConfigError: the file is missing or is not a model config, or its batch does not
            split over ``gpus`` ranks (:func:`global_batch`).
    """
    from megatron.model.gpt_moe import count_parameters
    from megatron.training.arguments import (model_config_from_args, padded_vocab_size,
                                             parse_args)
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file not found: {path}")
    try:
        args = parse_args(["--config", path, "--data-path", "unused"])
    except ConfigError as err:
        raise ConfigError(f"--config {path}: {err}") from None
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, name) is None:
            raise ConfigError(f"--config {path}: no {name.replace('_', '-')} (not a model "
                              f"config)")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    vocab = VOCAB.get(args.tokenizer_type, 50257)
    args.padded_vocab_size = padded_vocab_size(vocab, args.make_vocab_size_divisible_by)
    if ep_override:
        args.moe_expert_parallel_size = ep_override
    try:
        config = model_config_from_args(args)
    except ValueError as err:
        raise ConfigError(f"--config {path}: {err}") from None
    counts = count_parameters(config)
    batch = global_batch(path, args.global_batch_size, args.micro_batch_size, gpus)
    try:
        return ModelShape(os.path.splitext(os.path.basename(path))[0], counts["non_expert"],
                          counts["expert"], args.num_experts, len(config.moe_layer_indices),
                          batch * args.seq_length)
    except ValueError as err:  # the planner's bounds (no experts, an empty batch)
        raise ConfigError(f"--config {path}: {err}") from None


def global_batch(path: str, global_batch_size: Optional[int], micro_batch: Optional[int],
                 gpus: int) -> int:
    """The global batch the trainer runs with ``gpus`` data-parallel ranks (as
    ``megatron.training.arguments.validate_args``: unset, one micro-batch per rank; else
    a multiple of micro-batch x data-parallel size); ``gpus`` 0: unchecked, and an unset
    global batch is one micro-batch.

    Raises:
        ConfigError: naming the config ``path``, its batch flags and --gpus.
    """
    micro = micro_batch or 1
    if not gpus:
        return global_batch_size or micro
    per_step = micro * gpus
    if global_batch_size is None:
        return per_step
    if global_batch_size % per_step:
        raise ConfigError(f"--gpus {gpus}: --config {path} has --global-batch-size "
                          f"{global_batch_size}, which the trainer requires to be divisible "
                          f"by --micro-batch-size x data-parallel size ({micro} x {gpus} = "
                          f"{per_step})")
    return global_batch_size


def answer(stdin: TextIO, stdout: TextIO) -> int:
    """Read the planner's request from ``stdin`` and write the answer on ``stdout`` as one
    JSON line: the planner's ``ModelShape``'s fields (returns 0), or ``{"error": message}``
    naming the flag and file to fix (returns :attr:`ConfigError.exit_code`). Run by
    ``pretrain_gpt_moe.py --model-shape``, in the planner's working directory (a relative
    config path resolves from there)."""
    def handle(text: str) -> dict:
        request = ShapeRequest.from_json(text)
        return asdict(model_shape(request.config, request.ep, request.gpus))

    return answer_request(stdin, stdout, handle)
