"""The GPT-MoE model as a DeepSpeed ``PipelineModule``, for pipeline parallelism
(``--pipeline-model-parallel-size P``).

The layers are :class:`~megatron.model.gpt_moe.GPTMoEModel`'s, cut into a sequence of
pipeline layers:

    EmbeddingPipe (tied) | TransformerLayerPipe x num_layers | FinalNormPipe | head (tied)

- Between stages travel ``(hidden, aux, position_ids)``. ``aux`` is the sum of the MoE
  layers' load-balancing losses so far, carried as a second tensor, as Megatron-DeepSpeed's
  ``GPTModelPipe`` carries its MoE loss. The floats come first: DeepSpeed receives a
  stage's activations and its output gradients into one buffer per tuple position, reused
  whatever the dtype, so a float gradient at the position of the int64 position ids was
  received into an int64 buffer (measured: on the middle stages of PP = 4 the aux loss's
  gradient was garbage and the gradient norm 1e10; PP = 2 has no middle stage).
- The last stage's loss is ``lm_loss + moe_loss_coeff * aux`` (:class:`PipeLoss`).
- The output head is the word embedding, tied across the first and last stages with
  DeepSpeed's ``TiedLayerSpec`` (its gradient is summed over the two).
- Every parameter is initialised from the seed and the name it has in the whole
  ``GPTMoEModel`` (:func:`~megatron.model.gpt_moe.init_parameter`), so a pipeline run
  starts from the same weights as a run without one.

Experts: the expert-parallel groups are ``ep`` consecutive ranks of one stage (DeepSpeed's
groups with a pipeline), so a rank's expert-parallel rank is ``rank % ep``.

With tensor parallelism (T > 1) the layers are the same megatron-core ones as
``GPTMoEModel``'s (the vocabulary of the tied embedding and head split too, the loss the
vocab-parallel cross entropy), and the module is given DeepSpeed's pipe x data x model
topology, whose order (the tensor-parallel ranks innermost, the stage outermost) is
megatron-core's: its tensor-parallel groups, which the layers use, are the grid's
"model" groups.
"""

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model import tensor_parallel as tp
from megatron.model.config import GPTMoEConfig
from megatron.model.gpt_moe import (TransformerLayer, expert_global_name, init_parameter,
                                    layer_norm)

TIED_EMBEDDING = "embed"
"""DeepSpeed's tie key of the word embedding (first stage) and the output head (last)."""


class EmbeddingPipe(nn.Module):
    """Word (and learned position) embeddings: ``(tokens, position_ids)`` ->
    ``(hidden, aux, position_ids)``; also the output head on the last stage
    (:func:`head_forward`)."""

    global_prefix = ""

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.tensor_parallel = config.tensor_model_parallel_size > 1
        self.word_embeddings = tp.embedding(config.vocab_size, config.hidden_size,
                                            config.tensor_model_parallel_size)
        self.position_embeddings = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                                    if config.position_embedding_type == "learned_absolute" else None)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, inputs):
        tokens, position_ids = inputs
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        # A leaf that requires a gradient: the pipeline sends every float tensor's gradient
        # back, and a stage whose layers add no aux loss would otherwise have none.
        aux = torch.zeros(1, device=x.device, requires_grad=True)
        return self.embedding_dropout(x), aux, position_ids


def head_forward(embedding: EmbeddingPipe, inputs):
    """The output head: logits of the tied word embedding (this rank's vocabulary slice
    under tensor parallelism), and the aux loss."""
    x, aux = inputs
    if embedding.tensor_parallel:
        return tp.parallel_logits(x, embedding.word_embeddings.weight), aux
    return F.linear(x, embedding.word_embeddings.weight), aux


class OutputPipe(nn.Module):
    """The output layer of its own (``--untie-embeddings-and-output-weights``):
    ``(hidden, aux)`` -> ``(logits, aux)``, this rank's vocabulary slice under tensor
    parallelism."""

    global_prefix = ""

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.tensor_parallel = config.tensor_model_parallel_size > 1
        self.output_layer = tp.linear(config.hidden_size, config.vocab_size,
                                      config.tensor_model_parallel_size, "column", bias=False)

    def forward(self, inputs):
        x, aux = inputs
        if self.tensor_parallel:
            return tp.parallel_logits(x, self.output_layer.weight), aux
        return F.linear(x, self.output_layer.weight), aux


class TransformerLayerPipe(TransformerLayer):
    """One decoder layer on ``(hidden, aux, position_ids)``."""

    def __init__(self, config: GPTMoEConfig, index: int):
        super().__init__(config, index in set(config.moe_layer_indices))
        self.index = index
        self.global_prefix = f"layers.{index}."
        self.counts = None
        """Gate counts (``[num_experts]``, int64) of the training forwards since the last
        :func:`take_gate_counts`; None: none (or not an MoE layer)."""

    def forward(self, inputs):
        x, aux, position_ids = inputs
        x, layer_aux, counts = super().forward(x, position_ids)
        if layer_aux is not None:
            aux = aux + layer_aux.float()
            if self.training:  # evaluation routes tokens too, and trains no expert
                counts = counts.detach().to(torch.int64)
                self.counts = counts if self.counts is None else self.counts + counts
        return x, aux, position_ids


def take_gate_counts(module: nn.Module, num_experts: int, device) -> torch.Tensor:
    """``[num_moe_layers, num_experts]`` gate counts of the MoE layers of this stage's
    ``module`` (from :func:`build_pipe_model`) since the last call, in their rows of the
    whole model's (zeros elsewhere), on ``device``; resets them. Summed over the world,
    they are what ``GPTMoEModel`` counts."""
    from deepspeed_ext.engine.stages import stage_naming as naming_of
    naming = naming_of(module)
    out = torch.zeros(naming.num_moe_layers, num_experts, dtype=torch.int64, device=device)
    row = naming.first_moe_layer
    for sub in module.modules():
        if isinstance(sub, TransformerLayerPipe) and sub.is_moe:
            if sub.counts is not None:
                out[row] += sub.counts.to(device)
                sub.counts = None
            row += 1
    return out


class FinalNormPipe(nn.Module):
    """The final LayerNorm: ``(hidden, aux, position_ids)`` -> ``(hidden, aux)``."""

    global_prefix = "final_layernorm."

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.norm = layer_norm(config)

    def forward(self, inputs):
        x, aux, _ = inputs
        return self.norm(x), aux

    @staticmethod
    def global_name(local: str) -> str:
        return local.replace("norm.", "", 1)


class PipeLoss:
    """The last stage's loss function: ``((logits, aux), (labels, loss_mask))`` ->
    ``lm_loss + moe_loss_coeff * aux`` (the masked mean cross entropy, as
    ``GPTMoEModel`` computes it). The pipeline engine reports only that sum, so the two
    parts of every micro-batch are also added up here, for :meth:`take`."""

    def __init__(self, config: GPTMoEConfig):
        self.coeff = config.moe_loss_coeff
        self.tensor_parallel = config.tensor_model_parallel_size > 1
        self._parts = None

    def __call__(self, outputs, targets):
        (logits, aux), (labels, loss_mask) = outputs, targets
        if self.tensor_parallel:  # logits of this rank's vocabulary slice
            losses = tp.parallel_cross_entropy(logits.float(), labels).reshape(-1)
        else:
            losses = F.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                     labels.reshape(-1), reduction="none")
        mask = loss_mask.reshape(-1).float()
        lm_loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
        aux = aux.sum()
        parts = torch.stack((lm_loss.detach().double(), aux.detach().double(),
                             torch.ones((), dtype=torch.float64, device=lm_loss.device)))
        self._parts = parts if self._parts is None else self._parts + parts
        return lm_loss + self.coeff * aux

    def take(self, device) -> torch.Tensor:
        """``[lm loss sum, aux loss sum, micro-batches]`` since the last call (zeros on a
        stage that computes no loss), on ``device``; resets them."""
        parts = self._parts if self._parts is not None else torch.zeros(3, dtype=torch.float64)
        self._parts = None
        return parts.to(device)


def pipe_layers(config: GPTMoEConfig) -> List:
    """The layer specs of :func:`build_pipe_model`, in order."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    untied = config.untie_embeddings_and_output_weights
    specs = [LayerSpec(EmbeddingPipe, config) if untied else
             TiedLayerSpec(TIED_EMBEDDING, EmbeddingPipe, config,
                           tied_weight_attr=["word_embeddings.weight"])]
    specs += [LayerSpec(TransformerLayerPipe, config, i) for i in range(config.num_layers)]
    specs.append(LayerSpec(FinalNormPipe, config))
    specs.append(LayerSpec(OutputPipe, config) if untied else
                 TiedLayerSpec(TIED_EMBEDDING, EmbeddingPipe, config, forward_fn=head_forward,
                               tied_weight_attr=["word_embeddings.weight"]))
    return specs


def build_pipe_model(config: GPTMoEConfig, stages: int, ep_rank: int):
    """The ``PipelineModule`` of this rank's stage, initialised as ``GPTMoEModel`` would be.
    Every rank calls it after ``init_process_group`` (DeepSpeed's pipeline groups) and,
    with tensor parallelism, after megatron-core's ``initialize_model_parallel``.

    Raises:
        ValueError: a stage without an MoE layer; megatron-core's tensor-parallel size
            not the config's.
    """
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    size = config.tensor_model_parallel_size
    tp_rank, tp_size = tp.tp_rank_and_size() if size > 1 else (0, 1)
    if tp_size != size:
        raise ValueError(f"tensor_model_parallel_size {size}, but megatron-core's "
                         f"parallel_state has {tp_size}: initialise it first")
    topology = None
    if size > 1:
        if config.num_experts > 1:
            tp.allow_flat_gathers_on_gloo()  # DeepSpeed's MoE token gathers over the TP group
        topology = PipeModelDataParallelTopology(
            num_pp=stages, num_mp=size, num_dp=dist.get_world_size() // (stages * size))
    module = PipelineModule(layers=pipe_layers(config), num_stages=None if topology else stages,
                            topology=topology, loss_fn=PipeLoss(config),
                            partition_method="type:TransformerLayerPipe")
    check_stages_hold_experts(config, module.parts)
    if size > 1:  # the same marks as GPTMoEModel's (checkpoints, the gradient norm)
        tp.mark_partition_views(module, size, config.enable_expert_tensor_parallelism,
                                tp.Layout.of(config))
        if not config.enable_expert_tensor_parallelism:
            tp.mark_replicated_experts(module)
    init_pipe_weights(module, config, ep_rank, tp_rank)
    from deepspeed_ext.engine.stages import STAGE_NAMING_ATTR
    setattr(module, STAGE_NAMING_ATTR, stage_naming(module, config))
    return module


def stage_naming(module: nn.Module, config: GPTMoEConfig):
    """How this stage's ``PipelineModule`` names its parameters in ``GPTMoEModel``, for
    MoC checkpoints that load under any number of stages
    (:class:`deepspeed_ext.engine.stages.StageNaming`)."""
    from deepspeed_ext.engine.stages import StageNaming
    prefixes, layers = [], []
    for name, child in module.named_modules():
        prefix = getattr(child, "global_prefix", None)
        if prefix is None or not name:
            continue
        if isinstance(child, FinalNormPipe):
            prefixes.append((name + ".norm.", prefix))
        else:
            prefixes.append((name + ".", prefix))
        if isinstance(child, TransformerLayerPipe):
            layers.append(child.index)
    moe = list(config.moe_layer_indices)
    first = sum(1 for i in moe if layers and i < min(layers))
    return StageNaming(prefixes=tuple(prefixes), first_moe_layer=first, num_moe_layers=len(moe))


def check_stages_hold_experts(config: GPTMoEConfig, parts) -> None:
    """Refuse a partition in which a stage holds no MoE layer (``parts``: the
    ``PipelineModule``'s stage boundaries over :func:`pipe_layers`).

    DeepSpeed's ZeRO all-reduces each optimizer parameter group's gradient norm over the
    pipeline's model-parallel group, and the experts are a parameter group of their own:
    a stage without experts has one group fewer, so its ranks leave the step while the
    others wait in a collective (measured: the job hung). A stage without MoE layers also
    makes no expert groups, whose creation is a collective of the whole world.

    Raises:
        ValueError: naming the stage and the flags to change.
    """
    if config.num_experts <= 1:
        return
    moe = set(config.moe_layer_indices)
    for stage in range(len(parts) - 1):
        layers = [i - 1 for i in range(parts[stage], parts[stage + 1]) if 1 <= i <= config.num_layers]
        if not moe.intersection(layers):
            raise ValueError(
                f"pipeline stage {stage} holds transformer layers {layers} and no MoE layer: "
                f"with MoE, every stage needs one (DeepSpeed's ZeRO reduces each optimizer "
                f"parameter group's norm over the pipeline). Change --expert-interval "
                f"({config.expert_interval}), --num-layers ({config.num_layers}) or "
                f"--pipeline-model-parallel-size")


def init_pipe_weights(module: nn.Module, config: GPTMoEConfig, ep_rank: int,
                      tp_rank: int = 0) -> List[str]:
    """Initialise every parameter of this stage's layers by its ``GPTMoEModel`` name (the
    slice of tensor-parallel rank ``tp_rank``); returns those names (the tied embedding
    once)."""
    names = []
    for sub in module.modules():  # each module once, the tied embedding too
        prefix = getattr(sub, "global_prefix", None)
        if prefix is None:
            continue
        for local, param in sub.named_parameters():
            if isinstance(sub, FinalNormPipe):
                local = FinalNormPipe.global_name(local)
            name = expert_global_name(prefix + local, ep_rank, config.num_local_experts)
            init_parameter(config, name, param, tp_rank)
            names.append(name)
    return names
