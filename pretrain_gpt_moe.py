"""Pretrain a GPT-MoE model on DeepSpeed (ZeRO + expert parallelism).

Run with ``deepspeed pretrain_gpt_moe.py --config configs/small.yaml ...``,
``torchrun --nproc_per_node N pretrain_gpt_moe.py ...`` or plain ``python`` (one rank).
"""

import warnings

from megatron.training.exit import exit_without_teardown


def _quiet_known_warnings() -> None:
    """Drop warnings that libraries print on every rank and that users cannot act on."""
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated")


def main(argv=None) -> int:
    """Parse, train, and turn bad input into exit code 2 on every rank."""
    _quiet_known_warnings()
    from megatron.training.errors import ConfigError
    from megatron.training.log import fatal
    try:
        from megatron.training.arguments import parse_args
        from megatron.training.training import pretrain, remove_deepspeed_shm_buffers
        pretrain(parse_args(argv))
        remove_deepspeed_shm_buffers()
    except ConfigError as e:
        fatal(str(e))
        return ConfigError.exit_code
    finally:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main_cli() -> None:
    """Console-script entry point (``moc-pretrain``)."""
    exit_without_teardown(main())


if __name__ == "__main__":
    exit_without_teardown(main())
