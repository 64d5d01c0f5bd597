"""Load a Qwen-VL model with its tokenizer and image processor: built-in tiny models and real checkpoints.

`load_bundle("builtin:tiny-qwen2.5-vl")` goes through the on-disk cache (`stagectl.models.tiny`);
`load_bundle("/path/to/Qwen2.5-VL-3B-Instruct")` loads a local Qwen2-VL / Qwen2.5-VL / Qwen3-VL
checkpoint through the same code. Text-only Qwen2 checkpoints (`builtin:tiny-qwen2`) load too; they
have no image processor (`ModelBundle.image_processor is None`). Nothing is ever downloaded. A
checkpoint whose tokenizer lacks the coordinate tokens gets them added (not special) and its
embeddings resized to fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2ForCausalLM,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stagectl.models.images import load_image_processor
from stagectl.models.tiny import BUILTIN_PREFIX, resolve_builtin
from stagectl.models.tokenizer import IM_END, add_coord_tokens, coord_token_ids, token_id

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
TorchDtype = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "qwen2": Qwen2ForCausalLM,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}


@dataclass
class ModelBundle:
    """Everything needed to encode, train and generate with one model."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    image_processor: Qwen2VLImageProcessorPil | None  # None: a text-only model
    coord_token_ids: list[int]  # id of <|coord_k|> at index k, k = 0..999
    end_of_turn_id: int  # <|im_end|>
    path: Path  # the checkpoint directory actually loaded

    def require_image_processor(self) -> Qwen2VLImageProcessorPil:
        """The image processor; `ValueError` for a text-only model (it cannot take images)."""
        if self.image_processor is None:
            raise ValueError(
                f"{self.path} is a text-only model (no image processor): images need a vision-language "
                "model such as builtin:tiny-qwen2.5-vl"
            )
        return self.image_processor


def resolve_model_path(name_or_path: str) -> Path:
    """`builtin:` names -> their cache directory (built on first use); otherwise a checked local directory."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        return resolve_builtin(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory not found: {path} (use a local checkpoint or builtin:tiny-...)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model checkpoint: it has no config.json")
    return path


def has_image_processor(path: Path) -> bool:
    """Whether checkpoint `path` ships an image processor (vision-language checkpoints do)."""
    return (path / IMAGE_PROCESSOR_FILE).is_file()


def _model_type(path: Path) -> str:
    model_type = str(json.loads((path / "config.json").read_text()).get("model_type", ""))
    if model_type not in _MODEL_CLASSES:
        supported = ", ".join(sorted(_MODEL_CLASSES))
        raise ValueError(f"{path}: model_type {model_type!r} is not supported (supported: {supported})")
    return model_type


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with the 1000 coordinate tokens added when missing."""
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    add_coord_tokens(tokenizer)
    return tokenizer


def load_bundle(
    name_or_path: str,
    *,
    torch_dtype: TorchDtype = "float32",
    device: str = "cpu",
    attn_implementation: str | None = None,
) -> ModelBundle:
    """Load model + tokenizer + image processor (if the checkpoint has one); the model is in eval mode
    on `device`."""
    if torch_dtype not in _DTYPES:
        raise ValueError(f"torch_dtype {torch_dtype!r} is not one of {', '.join(_DTYPES)}")
    path = resolve_model_path(name_or_path)
    model_class = _MODEL_CLASSES[_model_type(path)]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    num_added = add_coord_tokens(tokenizer)
    model = model_class.from_pretrained(
        str(path), dtype=_DTYPES[torch_dtype], attn_implementation=attn_implementation
    )
    embedding_rows = model.config.get_text_config().vocab_size
    if num_added and len(tokenizer) > embedding_rows:
        # Real checkpoints pad their embeddings; grow them only when the new tokens do not fit.
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the real signature
    model.eval()
    return ModelBundle(
        model=model,
        tokenizer=tokenizer,
        image_processor=load_image_processor(path) if has_image_processor(path) else None,
        coord_token_ids=coord_token_ids(tokenizer),
        end_of_turn_id=token_id(tokenizer, IM_END),
        path=path,
    )


def load_model(
    name_or_path: str,
    *,
    torch_dtype: TorchDtype = "float32",
    device: str = "cpu",
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Only the model of `load_bundle` (coordinate tokens fitted into its embeddings)."""
    bundle = load_bundle(
        name_or_path, torch_dtype=torch_dtype, device=device, attn_implementation=attn_implementation
    )
    return bundle.model
