"""`stagectl export`: a train-ab checkpoint (or any model) -> a clean Hugging Face model directory.

Source: a checkpoint directory (`checkpoint-N/`, its `model/` is exported), a run directory (its newest
checkpoint), or any model directory / `builtin:` name. The model is loaded with the transformers Auto
classes and written back with `save_pretrained`: config + generation config + safetensors weights,
tokenizer with its chat template, image processor (vision-language models), and a README.md model card
that states what stagectl added. Nothing else: no optimizer, scheduler, RNG or trainer state, no
stagectl recipe files. The output loads with `from_pretrained` and `vllm serve` like the base model.

`add_coord_tokens=True` writes a copy of a base model with the 1000 coordinate tokens added (embeddings
grown to fit): the starting point a vLLM rollout server for detection training needs, since vLLM loads
the checkpoint from disk and cannot add tokens itself.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from stagectl.detection.coords import NUM_BINS, coord_token
from stagectl.files import check_new_output_dir, follow_umask, make_staging_dir
from stagectl.models.loading import TRAINER_STATE, TorchDtype, load_bundle, resolve_checkpoint
from stagectl.models.quiet import hf_progress_bars_off

# Keys transformers writes into tokenizer_config.json on a load -> save round trip that describe the
# loading machine rather than the tokenizer.
_LOAD_TIME_TOKENIZER_KEYS = ("is_local", "local_files_only")
# = stagectl.learner.checkpoint.MASTER_WEIGHTS: a ddp checkpoint's float32 parameters when model/ is stored in
# another dtype
MASTER_WEIGHTS = "master_weights.safetensors"
# = stagectl.learner.checkpoint.SHARDED_STATE: an fsdp checkpoint's float32 master shards and AdamW state (DCP)
SHARDED_STATE = "train_state"


@dataclass(frozen=True)
class ExportSummary:
    source: Path  # the model directory that was exported
    out: Path
    model_type: str
    auto_class: str  # the transformers Auto class that loads it
    num_parameters: int
    dtype: str
    coord_token_ids: tuple[int, int] | None  # (first, last) id of <|coord_0|>..<|coord_999|>, if present
    vocab_size: int  # embedding rows
    from_masters: bool = False  # the weights came from the checkpoint's float32 master weights


def export_model(
    source: str, out: Path, *, torch_dtype: TorchDtype | None = None, add_coord_tokens: bool = False
) -> ExportSummary:
    """Write `source`'s model as a clean Hugging Face directory `out` (new or empty); see the module doc.

    `torch_dtype` None keeps the checkpoint's dtype. The directory appears whole or not at all."""
    check_new_output_dir(out, "OUT")
    model_dir = resolve_checkpoint(source)
    saved = _saved_dtype(model_dir)
    dtype = torch_dtype or saved
    masters, shards = model_dir.parent / MASTER_WEIGHTS, model_dir.parent / SHARDED_STATE
    # `--dtype float32` (or float16) of a bf16-stored train-ab checkpoint: its float32 masters (ddp's file,
    # fsdp's DCP shards), not model/'s bf16 weights widened (they were, silently: the export said float32
    # and held bf16-rounded values)
    from_masters = (
        dtype != saved
        and (masters.is_file() or shards.is_dir())
        and (model_dir.parent / TRAINER_STATE).is_file()
    )
    bundle = load_bundle(
        str(model_dir), torch_dtype="float32" if from_masters else dtype, add_coord_tokens=add_coord_tokens
    )
    if from_masters:
        import torch

        if masters.is_file():
            from safetensors.torch import load_file

            bundle.model.load_state_dict(load_file(str(masters)), strict=True)
        else:
            _load_sharded_masters(bundle.model, shards)
        bundle.model.to(getattr(torch, dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = make_staging_dir(out.parent, f".{out.name}.")  # the umask's mode, not mkdtemp's 0700
    try:
        bundle.model.config.use_cache = True  # a learner checkpoint may have saved it off
        _save_quietly(bundle.model, staging)
        bundle.tokenizer.save_pretrained(staging)
        if bundle.image_processor is not None:
            bundle.image_processor.save_pretrained(staging)
        _clean_tokenizer_config(staging / "tokenizer_config.json")
        coords = (bundle.coord_ids[0], bundle.coord_ids[-1]) if bundle.coord_ids else None
        summary = ExportSummary(
            source=model_dir,
            out=out,
            model_type=bundle.model_type,
            auto_class="AutoModelForImageTextToText" if bundle.vision_language else "AutoModelForCausalLM",
            num_parameters=sum(p.numel() for p in bundle.model.parameters()),
            dtype=dtype,
            coord_token_ids=coords,
            vocab_size=int(bundle.model.config.get_text_config().vocab_size),
            from_masters=from_masters,
        )
        (staging / "README.md").write_text(model_card(summary))
        follow_umask(staging)  # save_pretrained leaves model.safetensors 0600
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary


def _load_sharded_masters(model: Any, shards: Path) -> None:
    """Load an fsdp checkpoint's float32 master weights from its DCP shards into `model` (float32, the
    checkpoint's own model/ structure), in this one process. Shards that do not hold every weight of model/
    are refused rather than half applied."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = dcp.FileSystemReader(str(shards))
    stored = reader.read_metadata().state_dict_metadata
    weights = model.state_dict()  # views of the parameters: dcp.load fills them in place
    missing = [name for name in weights if f"model.{name}" not in stored]
    if missing:
        raise ValueError(
            f"{shards}: the checkpoint's float32 master shards do not hold {len(missing)} of model/'s weights "
            f"(e.g. {missing[0]}); export it in model/'s own dtype (leave out --dtype)"
        )
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            {"model": weights}, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True)
        )


def _save_quietly(model: Any, path: Path) -> None:
    with hf_progress_bars_off():
        model.save_pretrained(path, safe_serialization=True)


def _saved_dtype(model_dir: Path) -> TorchDtype:
    config = json.loads((model_dir / "config.json").read_text())
    saved = config.get("dtype") or config.get("torch_dtype") or "float32"
    if saved not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{model_dir}: config.json dtype {saved!r}; pass --dtype float32|bfloat16|float16")
    return cast(TorchDtype, saved)


def _clean_tokenizer_config(path: Path) -> None:
    config = json.loads(path.read_text())
    for key in _LOAD_TIME_TOKENIZER_KEYS:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def model_card(summary: ExportSummary) -> str:
    """README.md of an exported model: what it is, what stagectl added, how to load it."""
    if summary.coord_token_ids is not None:
        first, last = summary.coord_token_ids
        added = (
            f"- {NUM_BINS} coordinate tokens `{coord_token(0)}`..`{coord_token(NUM_BINS - 1)}` (ids {first}..{last}, "
            "added tokens, not special: they decode as text). A box is written as four of them, "
            "`x1 y1 x2 y2` in 0..999 bins of the image width/height.\n"
            f"- embedding and output rows: {summary.vocab_size} (`vocab_size` in config.json covers every "
            "token id).\n"
        )
    else:
        added = "- nothing: the tokenizer and the weights have the base model's layout.\n"
    return (
        f"# {summary.out.name}\n\n"
        f"Exported by `stagectl export` from `{summary.source}` ({summary.model_type}, "
        f"{summary.num_parameters:,} parameters, {summary.dtype}).\n\n"
        "## What stagectl added to the base model\n\n"
        f"{added}"
        "- weight names, chat template and generation config are the base model's.\n\n"
        "## Loading\n\n"
        "```python\n"
        f"from transformers import {summary.auto_class}, AutoTokenizer\n"
        f'model = {summary.auto_class}.from_pretrained("{summary.out.name}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{summary.out.name}")\n'
        "```\n\n"
        f"or `vllm serve {summary.out.name}`.\n"
    )
