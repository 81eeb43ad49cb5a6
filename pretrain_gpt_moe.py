"""Pretrain a GPT-MoE model on DeepSpeed (ZeRO + expert parallelism).

Run with ``deepspeed pretrain_gpt_moe.py --config configs/small.yaml ...``,
``torchrun --nproc_per_node N pretrain_gpt_moe.py ...`` or plain ``python`` (one rank).
"""

import sys
import warnings

from megatron.training.exit import exit_without_teardown

CHECK_REPLAY_FLAGS = "--check-replay-flags"
"""As the only argument: answer ``moc-ckpt densify``'s JSON request on stdin (which of a
recorded command's flags a replay may use) and train nothing; not a training flag
(:mod:`megatron.training.replay_flags`)."""

MODEL_SHAPE = "--model-shape"
"""As the only argument: answer ``moc-plan``'s JSON request on stdin (the shape of the
model a training config describes) and train nothing; not a training flag
(:mod:`megatron.training.model_shape`)."""


def _quiet_known_warnings() -> None:
    """Drop warnings that libraries print on every rank and that users cannot act on."""
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated")


def main(argv=None) -> int:
    """Parse, train, and turn bad input into exit code 2 on every rank; or, given only
    :data:`CHECK_REPLAY_FLAGS`, answer densify's flag check; given only
    :data:`MODEL_SHAPE`, answer moc-plan's model question.

    torch and DeepSpeed are imported after the arguments parse: ``--help`` and a
    mistyped flag answer in a fraction of a second instead of after their imports.
    """
    _quiet_known_warnings()
    words = list(sys.argv[1:] if argv is None else argv)
    if words == [CHECK_REPLAY_FLAGS]:
        from megatron.training.replay_flags import answer
        return answer(sys.stdin, sys.stdout)
    if words == [MODEL_SHAPE]:
        from megatron.training.model_shape import answer as answer_shape
        return answer_shape(sys.stdin, sys.stdout)
    from megatron.errors import ConfigError
    try:
        from megatron.training.arguments import parse_args
        args = parse_args(argv)
        from megatron.training.training import pretrain, remove_deepspeed_shm_buffers
        if args.moc_restart == "in-job":  # every round of this process, under the supervisor
            return _run_in_job(words)
        pretrain(args)
        remove_deepspeed_shm_buffers()
    except ConfigError as e:
        # Printed here, not through megatron.training.log: importing that imports torch,
        # which a flag the parser refused does not need.
        print(f"error: {e}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    finally:
        _destroy_process_group()
    return 0


def _run_in_job(words) -> int:
    """``--moc-restart in-job``: this process trains in each round the supervisor gives
    its slot (:mod:`megatron.training.in_job`)."""
    import os
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.in_job import run_in_job
    from megatron.training.training import pretrain, remove_deepspeed_shm_buffers
    # Before a spare waits: bad flags stop every process now, not when a spare takes over.
    validate_args(parse_args(words), int(os.environ.get("WORLD_SIZE", "1")))

    def train(args) -> None:
        pretrain(args)
        remove_deepspeed_shm_buffers()

    import torch
    from megatron.training.process import abort_communicators
    # NCCL (CUDA) only: gloo cannot be aborted from another thread, and a gloo peer's
    # death closes the connections a survivor waits on anyway
    return run_in_job(words, parse_args, train, _destroy_process_group,
                      lambda line: print(line, flush=True),
                      abort=abort_communicators if torch.cuda.is_available() else None)


def _destroy_process_group() -> None:
    """Destroy the process groups if this run made any (torch imported means maybe):
    megatron-core's, DeepSpeed's cached ones and MoC's with the default group
    (:func:`megatron.training.process.close_process_groups`)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available():  # an aborted world is not initialized
        from megatron.training.process import close_process_groups
        close_process_groups()


def main_cli() -> None:
    """Console-script entry point (``moc-pretrain``)."""
    exit_without_teardown(main())


if __name__ == "__main__":
    exit_without_teardown(main())
