"""The built-in tiny models: config recipe, random init, save, and the on-disk cache.

`build_tiny_model(arch, out_dir)` writes a complete checkpoint directory (config, random weights,
generation config, tokenizer with chat template, image processor) that `from_pretrained` loads like
a real Qwen-VL checkpoint. Shapes: text hidden 128, 2 layers, 2 heads of head_dim 64, vision depth 2.
Weights come from a fixed seed, so two builds are identical.

`qwen2` is a text-only `Qwen2ForCausalLM` with the same tokenizer and text shapes (no vision tower,
no image processor) and an untied output head: the model the vLLM CPU build can serve. Its weights
are drawn with a larger spread than the default init, so the random model's greedy outputs vary
from token to token instead of repeating one id.

`llama3`, `qwen3` and `gemma3` are text chat models of other families with their real chat templates
and no coordinate tokens (`stagectl.models.tiny_chat`): what "any instruct checkpoint" looks like.

`resolve_builtin(name)` maps `builtin:tiny-qwen2.5-vl` (and the other architectures' names)
to a cache directory, building it once. Concurrent builders (torchrun ranks) serialise on a file lock
and publish with an atomic rename, so nobody ever sees a half-written checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
from pathlib import Path
from typing import Literal, cast, get_args

import torch
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from stagectl.cache import cache_root as stagectl_cache_root
from stagectl.models.images import build_image_processor
from stagectl.models.quiet import hf_progress_bars_off
from stagectl.models.tiny_chat import (
    ChatArch,
    build_chat_tokenizer,
    chat_config,
    chat_generation_config,
    chat_model_class,
)
from stagectl.models.tokenizer import (
    ENDOFTEXT,
    IM_END,
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    build_tiny_tokenizer,
    token_id,
)

TinyArch = Literal["qwen2.5-vl", "qwen2-vl", "qwen3-vl", "qwen2", "llama3", "qwen3", "gemma3"]
TINY_ARCHS: tuple[str, ...] = get_args(TinyArch)
CHAT_ARCHS: tuple[ChatArch, ...] = get_args(ChatArch)
BUILTIN_PREFIX = "builtin:"
# Bump when the recipe (tokenizer corpus, shapes, seed) changes: cached builds are then rebuilt.
RECIPE_VERSION = 1
RECIPE_FILE = "stagectl_recipe.json"
SEED = 1234

TEXT_HIDDEN = 128
TEXT_LAYERS = 2
TEXT_HEADS = 2  # head_dim = 64
VISION_HIDDEN = 64
VISION_HEADS = 2
VISION_DEPTH = 2
TEXT_ONLY_INIT_STD = 0.2  # `qwen2`: weight init spread (the default 0.02 gives near-constant greedy outputs)


def _text_config(vocab_size: int, ids: dict[str, int], mrope_section: list[int] | None) -> dict:
    """The language model's config; `mrope_section` (vision-language models) splits rotary dims by axis."""
    rope: dict = {"rope_type": "default", "rope_theta": 10000.0}
    if mrope_section is not None:
        rope["mrope_section"] = mrope_section
    return {
        "vocab_size": vocab_size,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 4 * TEXT_HIDDEN,
        "num_hidden_layers": TEXT_LAYERS,
        "num_attention_heads": TEXT_HEADS,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "rope_parameters": rope,
        "bos_token_id": ids["endoftext"],
        "eos_token_id": ids["im_end"],
        "pad_token_id": ids["endoftext"],
    }


def tiny_config(arch: TinyArch, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The model config for one tiny architecture, with special-token ids taken from `tokenizer`."""
    vocab = tokenizer.get_vocab()
    ids = {
        "endoftext": vocab[ENDOFTEXT],
        "im_end": vocab[IM_END],
        "image": vocab[IMAGE_PAD],
        "video": vocab[VIDEO_PAD],
        "vision_start": vocab[VISION_START],
        "vision_end": vocab[VISION_END],
    }
    vocab_size = -(-len(tokenizer) // 64) * 64  # pad the embedding rows to a multiple of 64
    if arch == "qwen2":
        return Qwen2Config(
            **_text_config(vocab_size, ids, None),
            tie_word_embeddings=False,  # vLLM's CPU build keeps a stale packed copy of a tied head
            initializer_range=TEXT_ONLY_INIT_STD,
        )
    vision_common = {"depth": VISION_DEPTH, "num_heads": VISION_HEADS, "spatial_merge_size": 2}
    if arch == "qwen2.5-vl":
        return Qwen2_5_VLConfig(
            text_config=_text_config(vocab_size, ids, [8, 12, 12]),  # sums to head_dim / 2
            vision_config={
                **vision_common,
                "hidden_size": VISION_HIDDEN,
                "intermediate_size": 2 * VISION_HIDDEN,
                "out_hidden_size": TEXT_HIDDEN,
                "patch_size": 14,
                "window_size": 112,
                "fullatt_block_indexes": [VISION_DEPTH - 1],
            },
            image_token_id=ids["image"],
            video_token_id=ids["video"],
            vision_start_token_id=ids["vision_start"],
            vision_end_token_id=ids["vision_end"],
        )
    if arch == "qwen2-vl":
        return Qwen2VLConfig(
            text_config=_text_config(vocab_size, ids, [8, 12, 12]),
            vision_config={
                **vision_common,
                "embed_dim": VISION_HIDDEN,
                "hidden_size": TEXT_HIDDEN,  # Qwen2-VL's vision `hidden_size` is the merger's output
                "mlp_ratio": 2,
                "patch_size": 14,
            },
            image_token_id=ids["image"],
            video_token_id=ids["video"],
            vision_start_token_id=ids["vision_start"],
            vision_end_token_id=ids["vision_end"],
        )
    if arch == "qwen3-vl":
        text = _text_config(vocab_size, ids, [12, 10, 10])  # interleaved: 3 * 10 <= head_dim / 2
        text["rope_parameters"]["mrope_interleaved"] = True
        text["head_dim"] = TEXT_HIDDEN // TEXT_HEADS
        return Qwen3VLConfig(
            text_config=text,
            vision_config={
                **vision_common,
                "hidden_size": VISION_HIDDEN,
                "intermediate_size": 2 * VISION_HIDDEN,
                "out_hidden_size": TEXT_HIDDEN,
                "patch_size": 16,
                "num_position_embeddings": 256,  # a 16 x 16 grid, interpolated to any image size
                "deepstack_visual_indexes": [0],
            },
            image_token_id=ids["image"],
            video_token_id=ids["video"],
            vision_start_token_id=ids["vision_start"],
            vision_end_token_id=ids["vision_end"],
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")


def _model_class(arch: TinyArch) -> type[PreTrainedModel]:
    if arch == "qwen2":
        return Qwen2ForCausalLM
    if arch == "qwen2.5-vl":
        return Qwen2_5_VLForConditionalGeneration
    if arch == "qwen2-vl":
        return Qwen2VLForConditionalGeneration
    return Qwen3VLForConditionalGeneration


def build_tiny_model(arch: TinyArch, out_dir: str | Path) -> Path:
    """Build the tiny `arch` checkpoint (random weights from a fixed seed) into `out_dir`; returns it."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    out = Path(out_dir)
    if arch in CHAT_ARCHS:
        _build_chat_model(cast(ChatArch, arch), out)
    else:
        _build_qwen_model(arch, out)
    recipe = {"arch": arch, "recipe_version": RECIPE_VERSION, "seed": SEED}
    (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    return out


def _save_quietly(model: PreTrainedModel, out: Path) -> None:
    with hf_progress_bars_off():  # a one-shard save needs no progress bar
        model.save_pretrained(out)


def _build_chat_model(arch: ChatArch, out: Path) -> None:
    tokenizer = build_chat_tokenizer(arch)
    torch.manual_seed(SEED)
    model = chat_model_class(arch)(chat_config(arch, tokenizer))
    model.generation_config = chat_generation_config(arch, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, out)
    tokenizer.save_pretrained(out)


def _build_qwen_model(arch: TinyArch, out: Path) -> None:
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(arch, tokenizer)
    torch.manual_seed(SEED)
    model = _model_class(arch)(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[token_id(tokenizer, IM_END), token_id(tokenizer, ENDOFTEXT)],
        pad_token_id=token_id(tokenizer, ENDOFTEXT),
        do_sample=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, out)
    tokenizer.save_pretrained(out)
    if arch != "qwen2":  # a text-only model has no image processor
        build_image_processor(patch_size=config.vision_config.patch_size).save_pretrained(out)


def cache_root() -> Path:
    """Where built-in tiny models are cached: `{stagectl cache}/models`."""
    return stagectl_cache_root() / "models"


def builtin_arch(name: str) -> TinyArch:
    """`builtin:tiny-qwen2.5-vl` -> `qwen2.5-vl`; `ValueError` naming the choices otherwise."""
    arch = name.removeprefix(BUILTIN_PREFIX).removeprefix("tiny-")
    for known in get_args(TinyArch):
        if arch == known:
            return known
    choices = ", ".join(f"{BUILTIN_PREFIX}tiny-{a}" for a in TINY_ARCHS)
    raise ValueError(f"unknown built-in model {name!r}; choose one of {choices}")


def _is_current(path: Path, arch: TinyArch) -> bool:
    recipe = path / RECIPE_FILE
    if not recipe.is_file():
        return False
    found = json.loads(recipe.read_text())
    return bool(found.get("arch") == arch and found.get("recipe_version") == RECIPE_VERSION)


def resolve_builtin(name: str) -> Path:
    """The cache directory of built-in model `name`, building it first if missing or outdated."""
    arch = builtin_arch(name)
    root = cache_root()
    final = root / f"tiny-{arch}"
    if _is_current(final, arch):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"tiny-{arch}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _is_current(final, arch):  # another process built it while we waited
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".tiny-{arch}.", dir=root))
        build_tiny_model(arch, staging)
        if final.exists():  # an outdated build: move it aside, then publish the new one
            stale = Path(tempfile.mkdtemp(prefix=f".stale-tiny-{arch}.", dir=root))
            final.rename(stale / "old")
            shutil.rmtree(stale)
        staging.rename(final)
    return final
