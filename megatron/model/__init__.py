"""GPT-MoE model: a GPT decoder with ``deepspeed.moe`` expert layers."""

from megatron.model.config import GPTMoEConfig
from megatron.model.gpt_moe import GPTMoEModel, count_parameters

__all__ = ["GPTMoEConfig", "GPTMoEModel", "count_parameters"]
