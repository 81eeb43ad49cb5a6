"""Typed configuration of the GPT-MoE model."""

from dataclasses import dataclass


@dataclass
class GPTMoEConfig:
    """Shape and MoE settings of a :class:`~megatron.model.gpt_moe.GPTMoEModel`.

    Every field mirrors a Megatron-DeepSpeed flag of the same name (underscores for
    dashes); :func:`megatron.training.arguments.model_config_from_args` builds one.
    """

    num_layers: int
    """Transformer layers (``--num-layers``)."""
    hidden_size: int
    """Model width (``--hidden-size``)."""
    num_attention_heads: int
    """Attention heads; must divide ``hidden_size`` (``--num-attention-heads``)."""
    vocab_size: int
    """Vocabulary size after padding (from the tokenizer)."""
    max_position_embeddings: int
    """Longest sequence the position table covers (``--max-position-embeddings``)."""
    ffn_hidden_size: int = 0
    """MLP inner width; 0 means 4 * hidden_size (``--ffn-hidden-size``)."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` or ``rope`` (``--position-embedding-type``)."""
    num_experts: int = 1
    """Experts per MoE layer; 1 means a dense model (``--num-experts``)."""
    expert_interval: int = 2
    """Every ``expert_interval``-th layer is an MoE layer (``--expert-interval``)."""
    moe_expert_parallel_size: int = 1
    """Ranks the experts of one layer are spread over (``--moe-expert-parallel-size``)."""
    topk: int = 1
    """Experts each token is routed to (``--topk``)."""
    moe_train_capacity_factor: float = 1.0
    """Expert capacity factor in training (``--moe-train-capacity-factor``)."""
    moe_eval_capacity_factor: float = 1.0
    """Expert capacity factor in evaluation (``--moe-eval-capacity-factor``)."""
    moe_min_capacity: int = 4
    """Lower bound on expert capacity in tokens (``--moe-min-capacity``)."""
    moe_token_dropping: bool = True
    """Drop tokens over capacity (``--disable-moe-token-dropping`` turns it off)."""
    moe_loss_coeff: float = 0.01
    """Weight of the auxiliary load-balancing loss (``--moe-loss-coeff``)."""
    hidden_dropout: float = 0.1
    """Dropout after attention and MLP (``--hidden-dropout``)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (``--attention-dropout``)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight init (``--init-method-std``)."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon (``--layernorm-epsilon``)."""
    seed: int = 1234
    """Seed of the weight init; each tensor is seeded by its global name (``--seed``)."""
    tensor_model_parallel_size: int = 1
    """Ranks each layer's attention heads, dense MLP and vocabulary are split over
    (``--tensor-model-parallel-size``)."""
    enable_expert_tensor_parallelism: bool = False
    """Split each expert's MLP over the tensor-parallel ranks too, as DeepSpeed's expert
    sharding (``--enable-expert-tensor-parallelism``)."""
    checkpoint_activations: bool = False
    """Recompute each transformer layer in the backward pass instead of keeping its
    activations (``--checkpoint-activations``); the losses and gradients are the same."""
    swiglu: bool = False
    """The dense MLP and the experts gated with SiLU: ``dense_h_to_4h`` gives
    ``2 * ffn_hidden_size`` rows, the gate's then the up projection's (``--swiglu``)."""
    normalization: str = "layernorm"
    """``layernorm`` or ``rmsnorm`` (weight only) for every norm (``--normalization``)."""
    add_bias_linear: bool = True
    """Biases in every linear layer (``--disable-bias-linear`` turns them off)."""
    untie_embeddings_and_output_weights: bool = False
    """An output layer of its own (``output_layer.weight``) instead of the word embedding
    (``--untie-embeddings-and-output-weights``)."""
    num_key_value_heads: int = 0
    """Key and value heads (grouped-query attention); 0: one per attention head
    (``--num-key-value-heads``)."""
    rotary_interleaved: bool = True
    """With rope: rotate adjacent pairs of dimensions (this trainer's ``rope``); False:
    the two halves of each head, as Megatron-DeepSpeed's and Hugging Face's
    (``--use-rotary-position-embeddings``)."""
    rope_theta: float = 10000.0
    """The rotary embedding's base (``--rope-theta``)."""
    moe_top2_2nd_expert_sampling: bool = True
    """Top-2: draw each token's second expert with Gumbel noise, as DeepSpeed does by
    default; False: the second-largest gate (``--disable-moe-top2-2nd-expert-sampling``)."""

    def __post_init__(self):
        if self.ffn_hidden_size == 0:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_key_value_heads == 0:
            self.num_key_value_heads = self.num_attention_heads
        positive = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                    "max_position_embeddings", "ffn_hidden_size", "num_experts",
                    "expert_interval", "moe_expert_parallel_size", "topk",
                    "tensor_model_parallel_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size ({self.hidden_size}) must be divisible by "
                             f"--num-attention-heads ({self.num_attention_heads})")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError("--position-embedding-type must be learned_absolute or rope, "
                             f"got {self.position_embedding_type!r}")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head size, got {self.head_dim}")
        for name in ("num_attention_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) % self.tensor_model_parallel_size:
                raise ValueError(f"--{name.replace('_', '-')} ({getattr(self, name)}) must be divisible "
                                 f"by --tensor-model-parallel-size ({self.tensor_model_parallel_size})")
        if self.num_experts % self.moe_expert_parallel_size:
            raise ValueError(f"--num-experts ({self.num_experts}) must be divisible by "
                             f"--moe-expert-parallel-size ({self.moe_expert_parallel_size})")
        if self.num_experts > 1 and self.topk > self.num_experts:
            raise ValueError(f"--topk ({self.topk}) cannot exceed --num-experts ({self.num_experts})")
        if self.num_experts > 1 and self.topk > 2:
            raise ValueError(f"--topk must be 1 or 2 with deepspeed.moe, got {self.topk}")
        self._check_architecture()

    def _check_architecture(self) -> None:
        if self.normalization not in ("layernorm", "rmsnorm"):
            raise ValueError(f"--normalization must be layernorm or rmsnorm, got "
                             f"{self.normalization!r}")
        kv, heads = self.num_key_value_heads, self.num_attention_heads
        if kv < 1 or heads % kv:
            raise ValueError(f"--num-key-value-heads ({kv}) must divide --num-attention-heads "
                             f"({heads})")
        if kv % self.tensor_model_parallel_size:
            raise ValueError(f"--num-key-value-heads ({kv}) must be divisible by "
                             f"--tensor-model-parallel-size ({self.tensor_model_parallel_size})")

    @property
    def grouped_query(self) -> bool:
        """Fewer key-value heads than attention heads: the fused QKV rows are then grouped
        per key-value head, ``[kv_heads, heads / kv_heads + 2, head_dim]`` (upstream's
        layout); otherwise ``[3, heads, head_dim]``."""
        return self.num_key_value_heads < self.num_attention_heads

    @property
    def qkv_rows(self) -> int:
        """Output rows of the fused QKV projection."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def moe_layer_indices(self) -> list:
        """0-based indices of the MoE layers (layers 1, 3, 5, ... for interval 2)."""
        if self.num_experts <= 1:
            return []
        return [i for i in range(self.num_layers) if (i + 1) % self.expert_interval == 0]

    @property
    def num_local_experts(self) -> int:
        """Experts of one MoE layer held by each expert-parallel rank."""
        return self.num_experts // self.moe_expert_parallel_size
