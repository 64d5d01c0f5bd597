"""Load any chat checkpoint transformers knows, with its tokenizer, image processor and stop ids.

`load_bundle("builtin:tiny-qwen2.5-vl")` goes through the on-disk cache (`stagectl.models.tiny`);
`load_bundle("/path/to/checkpoint")` loads a local directory through the transformers Auto classes:
`AutoModelForImageTextToText` when the config has a vision tower, `AutoModelForCausalLM` otherwise.
Nothing is ever downloaded and no remote code runs.

- Image processor: the checkpoint's own (`AutoImageProcessor`, pillow backend: torchvision is not a
  dependency); a Qwen-VL checkpoint whose processor does not load that way falls back to the pillow
  `Qwen2VLImageProcessorPil`. Only Qwen-VL images can be put into a prompt (`stagectl.models.qwen_vl`).
- Stop ids: the chat template's end-of-turn plus every eos id of the generation config
  (`stagectl.models.turns`), never a hard-coded token.
- Coordinate tokens: only detection training needs `<|coord_0|>`..`<|coord_999|>`. With
  `add_coord_tokens=True` (what train-ab does) missing ones are added (not special) and the embeddings
  grown when they do not fit; with `False` (Stage-B, plain serving) the checkpoint loads unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stagectl.models import qwen_vl
from stagectl.models.capability import IMAGE_PROCESSOR_FILE
from stagectl.models.quiet import hf_progress_bars_off
from stagectl.models.tiny import BUILTIN_PREFIX, resolve_builtin
from stagectl.models.tokenizer import add_coord_tokens as add_coord_tokens_to
from stagectl.models.tokenizer import coord_token_ids
from stagectl.models.turns import generation_eos_ids, stop_token_ids
from stagectl.models.vision_attention import use_varlen_vision_attention

TRAINER_STATE = "trainer_state.json"  # = stagectl.learner.checkpoint.TRAINER_STATE: the checkpoint is whole
TorchDtype = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelBundle:
    """Everything needed to encode, train and generate with one model."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    image_processor: Any | None  # the checkpoint's own; None: a text-only model (or one that did not load)
    model_type: str  # config.model_type, e.g. "llama", "qwen2_5_vl"
    vision_language: bool  # the model has a vision tower
    end_of_turn_id: int  # closes an assistant turn (from the chat template)
    stop_token_ids: list[int]  # generation stops at any of these (end-of-turn + every eos id)
    coord_ids: list[int] | None  # id of <|coord_k|> at index k; None: the tokenizer has none
    path: Path  # the checkpoint directory actually loaded

    @property
    def coord_token_ids(self) -> list[int]:
        """The 1000 coordinate token ids; `ValueError` when the model was loaded without them."""
        if self.coord_ids is None:
            raise ValueError(
                f"{self.path} has no coordinate tokens: detection needs the model loaded with "
                "add_coord_tokens=True (as train-ab loads it)"
            )
        return self.coord_ids

    def require_image_processor(self) -> Qwen2VLImageProcessorPil:
        """The Qwen-VL image processor; `ValueError` for a model that cannot take images here."""
        if not self.vision_language:
            raise ValueError(
                f"{self.path} is a text-only model (no image processor): images need a vision-language "
                "model such as builtin:tiny-qwen2.5-vl"
            )
        if self.image_processor is None:
            raise ValueError(
                f"{self.path} is a vision-language model ({self.model_type}) but its image processor did "
                "not load with the pillow backend"
            )
        return qwen_vl.require_image_processor(self.image_processor, self.model_type)


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
        raise ValueError(f"{path} is not a model checkpoint: it has no config.json{_what_it_is(path)}")
    return path


def _what_it_is(path: Path) -> str:
    """What a directory without config.json is when train-ab wrote it, and the model directory to give instead
    (a train-ab checkpoint keeps its weights in model/, unlike an HF Trainer checkpoint-N/)."""
    if (path / TRAINER_STATE).is_file() and (path / "model" / "config.json").is_file():
        return f"; it is a train-ab checkpoint, whose weights are in {path / 'model'}: give that"
    if (path / "adapter_config.json").is_file():
        merged = path.parent / "model"
        if path.name == "adapter" and (merged / "config.json").is_file():
            return f"; it is a LoRA adapter, and {merged} beside it holds the merged weights: give that"
        return "; it is a LoRA adapter: give its base model (with model.adapter), or merge it into the base first"
    complete = sorted(
        (int(child.name.removeprefix("checkpoint-")), child)
        for child in path.glob("checkpoint-*")
        if child.name.removeprefix("checkpoint-").isdigit() and (child / TRAINER_STATE).is_file()
    )
    if complete and (complete[-1][1] / "model" / "config.json").is_file():
        return f"; it is a train-ab run directory, whose newest checkpoint's weights are in {complete[-1][1] / 'model'}"
    return ""


def resolve_checkpoint(source: str) -> Path:
    """The model directory `source` names, as `stagectl export` and `stagectl eval --model` read it: a
    train-ab `checkpoint-N/` (its `model/`), a run directory (its newest complete checkpoint's `model/`), a
    model directory or a `builtin:` name. `FileNotFoundError` / `ValueError` say what `source` lacks."""
    if source.startswith(BUILTIN_PREFIX):
        return resolve_model_path(source)
    path = Path(source).expanduser()
    if (path / TRAINER_STATE).is_file() and (path / "model" / "config.json").is_file():
        return path / "model"
    checkpoint_name = path.name.removeprefix("checkpoint-").isdigit()
    if checkpoint_name and (path / "model").is_dir() and not (path / TRAINER_STATE).is_file():
        # a checkpoint-N/ whose save did not finish: its model/ may be cut short, so refuse it by name
        older = [c.name for c in path.parent.glob("checkpoint-*") if (c / TRAINER_STATE).is_file()]
        hint = f"; the newest complete one is in {path.parent}" if older else ""
        raise ValueError(
            f"{path} is an incomplete checkpoint: it has no {TRAINER_STATE} (a save that did not finish){hint}"
        )
    numbered = [
        (int(child.name.removeprefix("checkpoint-")), child)
        for child in path.glob("checkpoint-*")
        if child.name.removeprefix("checkpoint-").isdigit()
    ]
    complete = sorted((n, child) for n, child in numbered if (child / TRAINER_STATE).is_file())
    if (path / "config.json").is_file():
        return resolve_model_path(str(path))
    if complete:
        return complete[-1][1] / "model"
    if numbered:
        raise ValueError(
            f"{path} holds no complete checkpoint: none of {', '.join(sorted(c.name for _, c in numbered))} "
            f"has {TRAINER_STATE} (a save that did not finish); give a model directory or a finished run"
        )
    return resolve_model_path(str(path))


def has_image_processor(path: Path) -> bool:
    """Whether checkpoint `path` ships an image processor (vision-language checkpoints do)."""
    return (path / IMAGE_PROCESSOR_FILE).is_file()


def load_model_config(path: Path) -> PretrainedConfig:
    """The checkpoint's config; `ValueError` naming the checkpoint when transformers cannot read it."""
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(
            f"{path}: transformers {transformers.__version__} cannot load this checkpoint ({reason}); "
            "stagectl runs no remote code, so the architecture must be one transformers ships"
        ) from None


def model_class_for(config: PretrainedConfig) -> Any:
    """The Auto class that builds `config`'s generating model."""
    return AutoModelForImageTextToText if qwen_vl.is_vision_language(config) else AutoModelForCausalLM


def load_tokenizer(name_or_path: str, *, add_coord_tokens: bool = True) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; with `add_coord_tokens` the 1000 coordinate tokens are added if missing."""
    path = resolve_model_path(name_or_path)
    tokenizer = _read_tokenizer(path)
    if add_coord_tokens:
        add_coord_tokens_to(tokenizer)
    return tokenizer


TOKENIZER_VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")


def _read_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """`path`'s tokenizer; `ValueError` when it has no vocabulary file (transformers then builds a tokenizer of
    one token without a word, and the first missing special token is reported as the model's fault)."""
    if not any((path / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        raise ValueError(
            f"{path} has no tokenizer: none of {', '.join(TOKENIZER_VOCAB_FILES)} is there; copy the tokenizer "
            "files from the checkpoint it was trained from"
        )
    return AutoTokenizer.from_pretrained(str(path))


def checkpoint_stop_ids(path: Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, list[int]]:
    """`(end_of_turn_id, stop_ids)` of a checkpoint directory (see `stagectl.models.turns`)."""
    return stop_token_ids(tokenizer, generation_eos_ids(path))


def load_image_processor(path: Path, config: PretrainedConfig) -> Any | None:
    """The checkpoint's image processor on the pillow backend, the Qwen-VL pillow fallback, or None
    (a text-only model, or another family's processor that needs torchvision)."""
    if not qwen_vl.is_vision_language(config) or not has_image_processor(path):
        return None
    try:
        return AutoImageProcessor.from_pretrained(str(path), backend="pil")
    except (ValueError, ImportError, OSError, KeyError):
        if qwen_vl.is_qwen_vl(config):
            return Qwen2VLImageProcessorPil.from_pretrained(str(path))
        return None


def _coord_ids_or_none(tokenizer: PreTrainedTokenizerBase) -> list[int] | None:
    try:
        return coord_token_ids(tokenizer)
    except ValueError:
        return None


class DamagedWeightsError(ValueError):
    """A model directory whose weight files cannot be read (cut off or damaged)."""


@contextlib.contextmanager
def _weights_of(path: Path) -> Iterator[None]:
    """Reading `path`'s weight files: safetensors' or torch's error about a damaged file as one
    `DamagedWeightsError` naming the directory (it was the loader's traceback)."""
    try:
        yield
    except (SafetensorError, RuntimeError, EOFError) as exc:
        if isinstance(exc, RuntimeError) and "PytorchStreamReader" not in str(exc):
            raise  # not torch's reader failing on a file (a shape mismatch, out of memory: their own words)
        detail = str(exc).splitlines()[0].split(". ")[0][:200] if str(exc) else ""
        raise DamagedWeightsError(
            f"{path}: its weights cannot be loaded ({type(exc).__name__}: {detail}); a weight file is damaged "
            "or incomplete"
        ) from None


def load_bundle(
    name_or_path: str,
    *,
    torch_dtype: TorchDtype = "float32",
    device: str = "cpu",
    attn_implementation: str | None = None,
    add_coord_tokens: bool = True,
    on_meta: bool = False,
) -> ModelBundle:
    """Load model + tokenizer + image processor; the model is in eval mode on `device`.

    `add_coord_tokens=False` loads the checkpoint exactly as it is (Stage-B, plain serving).
    `on_meta=True` builds the model's structure on the meta device and reads no weight (`device` is
    ignored): an fsdp rank other than 0, which gets its shards from rank 0 (`sharding.shard_from_rank0`)."""
    if torch_dtype not in _DTYPES:
        raise ValueError(f"torch_dtype {torch_dtype!r} is not one of {', '.join(_DTYPES)}")
    path = resolve_model_path(name_or_path)
    config = load_model_config(path)
    tokenizer = _read_tokenizer(path)
    end_of_turn, stops = checkpoint_stop_ids(path, tokenizer)
    num_added = add_coord_tokens_to(tokenizer) if add_coord_tokens else 0
    if on_meta:
        with torch.device("meta"):
            model = model_class_for(config).from_config(
                config, dtype=_DTYPES[torch_dtype], attn_implementation=attn_implementation
            )
    else:
        with hf_progress_bars_off(), _weights_of(path):
            model = model_class_for(config).from_pretrained(
                str(path),
                config=config,
                dtype=_DTYPES[torch_dtype],
                attn_implementation=attn_implementation,
            )
    use_varlen_vision_attention(model)  # one attention call per vision layer instead of one per window
    embedding_rows = model.config.get_text_config().vocab_size
    if num_added and len(tokenizer) > embedding_rows:
        # Real checkpoints pad their embeddings; grow them only when the new tokens do not fit. (On meta
        # the new rows get no values: no mean to take; they come from rank 0 with the rest.)
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64, mean_resizing=not on_meta)
    if not on_meta:
        model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the real signature
    model.eval()
    return ModelBundle(
        model=model,
        tokenizer=tokenizer,
        image_processor=load_image_processor(path, config),
        model_type=str(config.model_type),
        vision_language=qwen_vl.is_vision_language(config),
        end_of_turn_id=end_of_turn,
        stop_token_ids=stops,
        coord_ids=_coord_ids_or_none(tokenizer),
        path=path,
    )


def load_model(
    name_or_path: str,
    *,
    torch_dtype: TorchDtype = "float32",
    device: str = "cpu",
    attn_implementation: str | None = None,
    add_coord_tokens: bool = True,
) -> PreTrainedModel:
    """Only the model of `load_bundle`."""
    bundle = load_bundle(
        name_or_path,
        torch_dtype=torch_dtype,
        device=device,
        attn_implementation=attn_implementation,
        add_coord_tokens=add_coord_tokens,
    )
    return bundle.model
