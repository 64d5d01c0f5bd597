"""`model` and `data` sections: what to load and what to train on."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from stagectl.config.base import StrictModel
from stagectl.config.dtypes import StorageDtype
from stagectl.config.rollout import DecodingConfig
from stagectl.config.user_path import UserPath

# the per-object confidence COCO AP ranks by (stagectl.detection.scores defines each)
ScoreKind = Literal["coord", "coord_desc", "objectness", "objectness_coord_desc"]
LM_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterConfig(StrictModel):
    """A LoRA / DoRA adapter (peft) on the language model's linear layers. With an adapter the whole base
    model is frozen and only the adapter trains (the vision tower and aligner get no adapter: ms-swift's
    default scope); `freeze_vit` / `freeze_aligner` change nothing then, and `freeze_llm` is refused since
    the adapter lives in the language model."""

    type: Literal["lora", "dora"] = "lora"
    """`lora`: W + (alpha/r)·B·A. `dora`: LoRA plus a learned per-row magnitude (peft's `use_dora`)."""
    r: int = Field(8, ge=1, le=1024)
    """Rank of the A (r × in) and B (out × r) matrices."""
    alpha: int = Field(16, ge=1)
    """LoRA alpha: the update is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during training (0 keeps Channel-A/B logits deterministic)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LM_LINEARS))
    """Names of the language model's linear layers that get an adapter, matched inside the language model
    only (never the vision tower, whose MLP also has `gate_proj`/`up_proj`/`down_proj`): any of
    q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""

    @model_validator(mode="after")
    def _known_targets(self) -> AdapterConfig:
        unknown = [t for t in self.target_modules if t not in LM_LINEARS]
        if not self.target_modules or unknown:
            raise ValueError(
                f"target_modules {unknown or '[]'}: choose one or more of {', '.join(LM_LINEARS)}"
            )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"target_modules {self.target_modules}: a name is listed twice")
        return self


class ModelConfig(StrictModel):
    name_or_path: str = "builtin:tiny-qwen2.5-vl"
    """A local checkpoint directory (any architecture transformers ships: train-ab needs a Qwen-VL model,
    Stage-B and the rollout server take any chat model), or a built-in tiny model: `builtin:tiny-qwen2.5-vl`,
    `builtin:tiny-qwen2-vl`, `builtin:tiny-qwen3-vl`, the text-only `builtin:tiny-qwen2`, or the text chat
    models `builtin:tiny-llama3`, `builtin:tiny-qwen3`, `builtin:tiny-gemma3` (built offline on first use,
    then cached)."""
    torch_dtype: StorageDtype = "float32"
    """The dtype weights are stored and served in: inference (rollout server, Stage-B) loads the model in
    it, and train-ab writes checkpoints and syncs weights in it. train-ab trains float32 master weights
    whatever this is; its compute dtype is `training.mixed_precision` (bf16 storage wants
    `mixed_precision: bf16`)."""
    freeze_vit: bool = False
    """Freeze the vision tower (ms-swift's `freeze_vit`): no gradient, no optimizer state."""
    freeze_aligner: bool = False
    """Freeze the aligner that projects vision features into the language model (Qwen-VL's patch merger;
    ms-swift's `freeze_aligner`)."""
    freeze_llm: bool = False
    """Freeze the language model, embeddings and LM head included (ms-swift's `freeze_llm`)."""
    adapter: AdapterConfig | None = None
    """Train a LoRA / DoRA adapter instead of the full model (train-ab only; see `AdapterConfig`).
    Checkpoints hold the merged weights in `model/` and the adapter in `adapter/`."""
    device_map: str | None = None
    """Hugging Face device map for single-process inference (`auto`); under torchrun every rank
    loads the full model on its own device and this is ignored."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    """Attention kernel; None lets transformers choose (sdpa on CPU)."""

    @model_validator(mode="after")
    def _adapter_in_the_llm(self) -> ModelConfig:
        if self.adapter is not None and self.freeze_llm:
            raise ValueError(
                "adapter with freeze_llm: true: the adapter lives in the language model; with an adapter "
                "the base model is frozen anyway, so unset freeze_llm"
            )
        return self


SideFractionBound = Annotated[float, Field(ge=0.05, le=0.9)]  # = stagectl.data.synthetic.SIDE_FRACTION_LIMITS


class SyntheticDataConfig(StrictModel):
    num_samples: int = Field(256, ge=1)
    """Number of synthetic shape images to draw."""
    seed: int = 0
    """Seed of the drawing; the same seed always gives the same images and boxes."""
    image_size: int = Field(112, ge=28, le=2048)
    """Side of the square images in pixels (a multiple of 28 suits the Qwen-VL patching)."""
    max_objects: int = Field(4, ge=1, le=8)
    """Most shapes per image (each image draws min_objects..max_objects)."""
    min_objects: int = Field(1, ge=1, le=8)
    """Fewest shapes per image drawn (a crowded image may hold fewer: a shape that finds no free place
    is left out); at most `max_objects`."""
    side_fraction: tuple[SideFractionBound, SideFractionBound] = (0.15, 0.35)
    """Range of shape sides as fractions of the image side, `[low, high]` within 0.05..0.9 (larger
    shapes are easier to learn: `examples/tiny/learn_shapes.yaml` uses `[0.3, 0.5]`)."""

    @model_validator(mode="after")
    def _side_range(self) -> SyntheticDataConfig:
        low, high = self.side_fraction
        if low > high:
            raise ValueError(f"side_fraction [{low}, {high}]: low must not exceed high")
        if self.min_objects > self.max_objects:
            raise ValueError(f"min_objects {self.min_objects} must not exceed max_objects {self.max_objects}")
        return self

    def generator_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `stagectl.data.synthetic.generate_synthetic` besides count and seed."""
        return {
            "image_size": self.image_size,
            "max_objects": self.max_objects,
            "min_objects": self.min_objects,
            "side_fraction": self.side_fraction,
        }


class EvalDataConfig(StrictModel):
    jsonl: UserPath | None = None
    """Held-out JSONL split (same format as `data.train_jsonl`)."""
    image_root: UserPath | None = None
    """Directory that image paths in `jsonl` are relative to (default: the JSONL's directory)."""
    synthetic: SyntheticDataConfig | None = None
    """Held-out synthetic split (use a seed different from training)."""
    every_steps: int = Field(0, ge=0)
    """Run a greedy-rollout eval every N optimizer steps (0 = only at the end)."""
    max_samples: int | None = Field(64, ge=1)
    """Evaluate on at most this many samples (the first ones; `stagectl eval` says when it stops short);
    null: every sample of the split (a COCO score over all of val2017: `--set data.eval.max_samples=null`).
    The default keeps train-ab's periodic eval short."""
    gallery_images: int = Field(24, ge=0)
    """`stagectl eval` (`--gallery N`): draw the N worst images (most misses + false positives; only images with
    one) with the ground truth and the predictions into `DIR/gallery/` (docs/reports.md); 0: no gallery."""
    decoding: DecodingConfig = Field(default_factory=lambda: DecodingConfig(temperature=0.0))
    """Sampling of the eval rollouts (train-ab's periodic eval and `stagectl eval`): greedy by default;
    with temperature > 0 image k is sampled with seed k. Length and repetition penalty come from
    `custom.extra.rollout_matching` (`max_new_tokens`, `repetition_penalty`)."""
    score: ScoreKind = "coord_desc"
    """Per-object confidence COCO AP ranks by, from the answer's logprobs: `coord` (geometric mean
    probability of the 4 coordinate tokens), `coord_desc` (0.7 coord + 0.3 desc tokens', upstream's
    fusion), `objectness` (probability of opening the object rather than closing the list),
    `objectness_coord_desc` (their product). Every eval also reports the AP of each kind and with every
    score 1 (`AP_by_score`, `AP_constant_score`); docs/evaluation.md gives the measurement behind the
    default (`coord_desc`: +0.022 AP over `coord` on the learn-shapes Stage-1 checkpoint)."""

    @model_validator(mode="after")
    def _one_split(self) -> EvalDataConfig:
        if self.jsonl is not None and self.synthetic is not None:  # one would be ignored without a word
            raise ValueError("set one of data.eval.jsonl or data.eval.synthetic, not both")
        return self


class DataConfig(StrictModel):
    train_jsonl: UserPath | None = None
    """Training JSONL: one `{images, width, height, objects: [{desc, bbox_2d}]}` per line."""
    image_root: UserPath | None = None
    """Directory that image paths in `train_jsonl` are relative to (default: the JSONL's directory)."""
    box_format: Literal["norm1000", "pixel", "auto"] = "norm1000"
    """How `bbox_2d` values are written: `norm1000` bins (integers 0..999), `pixel`, or `auto`
    (decided once per file; a file whose boxes fit both readings, or whose coordinates are integers up to
    exactly 1000, as a 0..1000 normalised scale writes them, is refused)."""
    synthetic: SyntheticDataConfig | None = None
    """Draw the synthetic shapes data set instead of reading `train_jsonl`."""
    eval: EvalDataConfig | None = None
    """Optional held-out split evaluated with greedy rollouts (precision/recall/F1 at IoU 0.5)."""

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.train_jsonl is None) == (self.synthetic is None):
            raise ValueError("set exactly one of data.train_jsonl or data.synthetic")
        return self
