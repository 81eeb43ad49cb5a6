"""The library's and the model's configurations built from validated arguments, and the
padded vocabulary both share."""

import argparse

from megatron.training.args.moc import effective_shm_dir


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Round the tokenizer's vocabulary up to a multiple of ``--make-vocab-size-divisible-by``
    times the tensor-parallel size (as Megatron does: each rank's vocabulary slice is then
    a multiple of the former)."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def moc_config_from_args(args: argparse.Namespace):
    """The :class:`deepspeed_ext.config.MoCConfig` of ``--moc-*`` (or the ``moc:`` YAML section)."""
    from deepspeed_ext.config import MoCConfig
    shm_dir = (effective_shm_dir(args) or "") if args.moc_two_level else ""
    pec_k = args.moc_k_persist if args.moc_k_persist is not None else args.moc_pec_k
    return MoCConfig(pec_k=pec_k, pec_policy=args.moc_pec_policy, pec_scope=args.moc_pec_scope,
                     keep=args.moc_keep, commit_timeout_s=args.moc_commit_timeout,
                     async_save=not args.moc_sync_save, two_level=args.moc_two_level,
                     k_snapshot=args.moc_k_snapshot, persist_interval=args.moc_persist_interval,
                     shm_dir=shm_dir, save_dir=args.save or args.load or "",
                     ranks_per_node=args.moc_ranks_per_node,
                     host_memory_gb=args.moc_host_memory_gb,
                     checksum_threads=args.moc_checksum_threads, redundancy=args.moc_redundancy,
                     replicas=args.moc_replicas, ec_data=args.moc_ec_data,
                     ec_parity=args.moc_ec_parity,
                     redundancy_interval=args.moc_redundancy_interval,
                     padded_vocab=padded_vocab_from_args(args))


VOCAB_TENSORS = ("word_embeddings.weight",)
"""The model's tensors whose rows are the padded vocabulary: the word embedding, which is
also the output layer (tied)."""
UNTIED_VOCAB_TENSORS = VOCAB_TENSORS + ("output_layer.weight",)
"""The same with ``--untie-embeddings-and-output-weights``."""


def padded_vocab_from_args(args: argparse.Namespace):
    """The :class:`deepspeed_ext.format.vocab.PaddedVocab` of the model (a MoC load under
    another padding trims or adds its padding rows); None while the tokenizer's size
    (``args.true_vocab_size``, set beside ``args.padded_vocab_size`` once the tokenizer is
    built) is not known."""
    from deepspeed_ext.format.vocab import PaddedVocab
    real = getattr(args, "true_vocab_size", None)
    if real is None or getattr(args, "padded_vocab_size", None) is None:
        return None
    names = (UNTIED_VOCAB_TENSORS if getattr(args, "untie_embeddings_and_output_weights", False)
             else VOCAB_TENSORS)
    return PaddedVocab(names, args.padded_vocab_size, real)


def model_config_from_args(args: argparse.Namespace):
    """The :class:`~megatron.model.config.GPTMoEConfig` the arguments describe."""
    from megatron.model.config import GPTMoEConfig
    return GPTMoEConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=args.padded_vocab_size,
        max_position_embeddings=args.max_position_embeddings, ffn_hidden_size=args.ffn_hidden_size,
        # --use-rotary-position-embeddings means rope, also before validation fills it in
        position_embedding_type=("rope" if getattr(args, "use_rotary_position_embeddings", False)
                                 else args.position_embedding_type), num_experts=args.num_experts,
        expert_interval=args.expert_interval, moe_expert_parallel_size=args.moe_expert_parallel_size,
        topk=args.topk, moe_train_capacity_factor=args.moe_train_capacity_factor,
        moe_eval_capacity_factor=args.moe_eval_capacity_factor,
        moe_min_capacity=args.moe_min_capacity,
        moe_token_dropping=not args.disable_moe_token_dropping, moe_loss_coeff=args.moe_loss_coeff,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, layernorm_epsilon=args.layernorm_epsilon,
        seed=args.seed,
        tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        enable_expert_tensor_parallelism=bool(getattr(args, "enable_expert_tensor_parallelism", False)),
        checkpoint_activations=bool(getattr(args, "checkpoint_activations", False)
                                    or getattr(args, "deepspeed_activation_checkpointing", False)),
        **_architecture(args))


def _architecture(args: argparse.Namespace) -> dict:
    """The architecture fields of :func:`model_config_from_args` (defaults: GPT's)."""
    rotary_halves = bool(getattr(args, "use_rotary_position_embeddings", False))
    return dict(
        swiglu=bool(getattr(args, "swiglu", False)),
        normalization=getattr(args, "normalization", "layernorm"),
        add_bias_linear=bool(getattr(args, "add_bias_linear", True)),
        untie_embeddings_and_output_weights=bool(
            getattr(args, "untie_embeddings_and_output_weights", False)),
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or 0,
        rotary_interleaved=not rotary_halves,
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        moe_top2_2nd_expert_sampling=bool(getattr(args, "moe_top2_2nd_expert_sampling", True)))
