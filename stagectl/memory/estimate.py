"""Per-rank training memory of the train-ab learner: weights, gradients, AdamW state, activations
(logits apart) and communication / compute buffers, in bytes, from a `ModelShape` and the training knobs.

The formulas (documented with numbers in docs/memory.md):

- Weights: every parameter once, in `param_bytes` (4 with `mixed_precision` bf16/fp16: the master copy;
  the model dtype with `mixed_precision: no` or `allow_low_precision_params`). LoRA/DoRA adds its
  adapter parameters. FSDP divides by the world size.
- Gradients and AdamW state (exp_avg, exp_avg_sq): trainable parameters only, 1x and 2x `param_bytes`.
  A frozen part (`freeze_vit`, `freeze_aligner`, `freeze_llm`) has neither; with an adapter only the
  adapter trains. FSDP divides by the world size.
- Activations of one micro-batch of T = `global_max_length` x `per_device_train_batch_size` tokens, in
  the compute dtype (e bytes). Per decoder layer and token the backward keeps the two norm inputs and
  outputs, q, k, v, the rotated q and k, the attention output, and the MLP's gate, up, act(gate) and
  product: (4h + 3q + 3kv + 4I) x e bytes (q = heads x head_dim, kv = kv_heads x head_dim; attention
  is fused, so no T x T score matrix). With gradient checkpointing each layer keeps only its input
  (h x e) and one layer's full set is rebuilt at a time during the backward. Either way one more
  layer's worth is counted for the gradients of the layer being back-propagated. The vision tower is
  the same over its patches (4 per image token after the 2x2 merge; `image_token_fraction` of T are
  image tokens), with full multi-head attention and a gated (Qwen2.5-VL) or plain MLP; a frozen tower
  stores nothing (no gradient flows into it).
- Attention masks: `flash_attention_2` reads the packed sequences' boundaries and keeps no mask. `sdpa`
  is handed the block-diagonal mask of a pack and keeps a T x T copy in the compute dtype per decoder
  layer (with checkpointing only the layer being rebuilt holds one); `eager` also keeps the softmax
  probabilities, T x T per head.
- Logits: T x V in the compute dtype, their float32 copy (the loss upcasts) and the float32 gradient:
  T x V x (e + 4 + 4) bytes (8 in float32, where the upcast is a no-op). At V = 152k and T = 4096 that
  is 6.2 GB, the largest single activation.
- Buffers: DDP's gradient buckets (a second copy of the trainable gradients; only with world size > 1)
  and, with mixed precision, the compute-dtype weight copies autocast keeps for the backward. FSDP:
  the root unit (embeddings, output head, mergers) unsharded for the whole step in the compute dtype,
  two blocks unsharded (the running one and the prefetched one) plus one block's float32 gradient
  before its reduce-scatter.

Not counted: the CUDA context and allocator fragmentation (keep ~10% of the card free), the optimizer's
scalar step counters, the data loader, the rollout server (it runs on other devices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stagectl.memory.shapes import ModelShape

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LM_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterKnobs:
    """`model.adapter`: LoRA / DoRA on the language model's linear layers."""

    type: Literal["lora", "dora"]
    r: int
    target_modules: tuple[str, ...]  # names from LM_LINEARS, or ("all-linear",)


@dataclass(frozen=True)
class TrainingKnobs:
    """The config keys the memory depends on (`training.*`, `model.*`, `global_max_length`) and the world
    size; `stagectl.memory.from_config.knobs_from_config` fills it from the config's `model` and `training` parts."""

    world_size: int = 1
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    allow_low_precision_params: bool = False
    torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False
    freeze_vit: bool = False
    freeze_aligner: bool = False
    freeze_llm: bool = False
    adapter: AdapterKnobs | None = None
    global_max_length: int = 2048
    per_device_train_batch_size: int = 1
    image_token_fraction: float = 0.5  # share of a packed sequence that is image tokens
    attention: Literal["flash_attention_2", "sdpa", "eager"] = "flash_attention_2"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.image_token_fraction <= 1:
            raise ValueError(f"image_token_fraction must be within 0..1, got {self.image_token_fraction}")

    @property
    def param_bytes(self) -> int:
        """Bytes per element of parameters, gradients and AdamW state."""
        if self.mixed_precision == "no" or self.allow_low_precision_params:
            return DTYPE_BYTES[self.torch_dtype]
        return 4  # float32 master weights under bf16/fp16 compute

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and compute copies of the weights."""
        return DTYPE_BYTES[self.torch_dtype] if self.mixed_precision == "no" else 2

    @property
    def num_tokens(self) -> int:
        return self.global_max_length * self.per_device_train_batch_size


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at the step's peak."""

    weights: int
    grads: int
    optimizer: int
    activations: int  # decoder layers + vision tower
    logits: int
    buffers: int  # DDP buckets, autocast / FSDP unsharded copies

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.buffers

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("weights", self.weights),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("logits", self.logits),
            ("buffers", self.buffers),
            ("total", self.total),
        ]


def adapter_params(shape: ModelShape, adapter: AdapterKnobs) -> int:
    """Parameters LoRA (A: r x in, B: out x r) or DoRA (plus a magnitude per output) adds to the LM."""
    targets = LM_LINEARS if adapter.target_modules == ("all-linear",) else adapter.target_modules
    unknown = [t for t in targets if t not in LM_LINEARS]
    if unknown:
        raise ValueError(
            f"adapter target_modules {unknown}: the memory model knows {', '.join(LM_LINEARS)} and all-linear"
        )
    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    dims = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    per_layer = sum(
        adapter.r * (dims[t][0] + dims[t][1]) + (dims[t][1] if adapter.type == "dora" else 0) for t in targets
    )
    return shape.num_layers * per_layer


def trainable_params(shape: ModelShape, knobs: TrainingKnobs) -> int:
    if knobs.adapter is not None:
        return adapter_params(shape, knobs.adapter)
    counts = shape.counts
    return (
        (0 if knobs.freeze_vit else counts.vision)
        + (0 if knobs.freeze_aligner else counts.aligner)
        + (0 if knobs.freeze_llm else counts.llm)
    )


def activation_bytes(shape: ModelShape, knobs: TrainingKnobs) -> int:
    """Decoder layers and vision tower (logits apart) of one micro-batch; see the module docstring."""
    e, tokens = knobs.compute_bytes, knobs.num_tokens
    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    layer_per_token = (4 * h + 3 * q + 3 * kv + 4 * inter) * e
    llm = _stack(tokens, shape.num_layers, layer_per_token, h * e, knobs.gradient_checkpointing)
    # checkpointed layers rebuild their mask in the backward: only the running layer holds one
    llm += (1 if knobs.gradient_checkpointing else shape.num_layers) * attention_matrix_bytes(shape, knobs)
    if knobs.freeze_vit or knobs.adapter is not None:
        return llm  # no gradient flows into a frozen tower, so autograd keeps none of its activations
    hv, iv = shape.vision_hidden_size, shape.vision_intermediate_size
    patches = int(tokens * knobs.image_token_fraction) * shape.spatial_merge_size**2
    block_per_patch = (10 * hv + (4 if shape.vision_gated_mlp else 2) * iv) * e
    vision = _stack(patches, shape.vision_depth, block_per_patch, hv * e, knobs.gradient_checkpointing)
    return llm + vision


def attention_matrix_bytes(shape: ModelShape, knobs: TrainingKnobs) -> int:
    """T x T tensors one decoder layer keeps for its backward (the mask; eager: the probabilities too)."""
    if knobs.attention == "flash_attention_2":
        return 0
    copies = 1 + (shape.num_heads if knobs.attention == "eager" else 0)
    return copies * knobs.num_tokens**2 * knobs.compute_bytes


def _stack(tokens: int, depth: int, per_token: int, input_per_token: int, checkpointing: bool) -> int:
    """Activation bytes of `depth` blocks; the last `per_token` is the block being back-propagated (its
    activations' gradients), which exists with or without checkpointing."""
    if checkpointing:  # each block keeps its input; one block is recomputed at a time
        return tokens * (depth * input_per_token + 2 * per_token)
    return tokens * (depth + 1) * per_token


def logits_bytes(shape: ModelShape, knobs: TrainingKnobs) -> int:
    e = knobs.compute_bytes
    upcast = 0 if e == 4 else 4
    return knobs.num_tokens * shape.vocab_size * (e + upcast + 4)


def estimate_memory(shape: ModelShape, knobs: TrainingKnobs) -> MemoryEstimate:
    """The per-rank breakdown of one rank of a `knobs.world_size`-rank run (see the module docstring)."""
    shard = knobs.world_size if knobs.parallelism == "fsdp" else 1
    pb, cb = knobs.param_bytes, knobs.compute_bytes
    extra = adapter_params(shape, knobs.adapter) if knobs.adapter is not None else 0
    all_params = shape.counts.total + extra
    trainable = trainable_params(shape, knobs)
    if knobs.parallelism == "ddp":
        buckets = trainable * pb if knobs.world_size > 1 else 0
        autocast_copies = all_params * cb if cb != pb else 0
        buffers = buckets + autocast_copies
    elif knobs.world_size == 1:
        buffers = 0
    else:
        block = max(shape.llm_layer_params, shape.vision_block_params)
        buffers = shape.root_params * cb + 2 * block * cb + block * 4
    return MemoryEstimate(
        weights=_ceil_div(all_params * pb, shard),
        grads=_ceil_div(trainable * pb, shard),
        optimizer=_ceil_div(2 * trainable * pb, shard),
        activations=activation_bytes(shape, knobs),
        logits=logits_bytes(shape, knobs),
        buffers=buffers,
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def format_table(estimate: MemoryEstimate, *, title: str, budget_bytes: int | None = None) -> list[str]:
    """The breakdown as aligned lines, GiB with two decimals, and the share of a device budget."""
    lines = [title]
    for name, value in estimate.rows():
        share = f"  {100 * value / budget_bytes:5.1f}%" if budget_bytes else ""
        lines.append(f"  {name:<12s}{value / GIB:10.2f} GiB{share}")
    return lines
