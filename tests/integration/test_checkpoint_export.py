"""A train-ab checkpoint's `model/` is a Hugging Face model other tools load: plain transformers reloads it
and generates the same greedy ids as stagectl does; its weight names and shapes are the base
checkpoint's (what `vllm serve` maps); `stagectl export` turns it into a clean directory to publish."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from stagectl.config.rollout import VllmEngineArgs
from stagectl.engines.vllm import VllmEngine
from stagectl.models.chat import encode_prompt
from stagectl.models.generate import SamplingSpec, generate_batch
from stagectl.models.loading import load_bundle, resolve_model_path
from stagectl.models.tokenizer import coord_token
from tests.integration.helpers import run_cli, tiny_train_config, write_config

pytestmark = pytest.mark.integration

BASE = "builtin:tiny-qwen2.5-vl"
INSTRUCTION = "Find every object."
MAX_TOKENS = 12
MODEL_FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two optimizer steps of train-ab (one A, one B) on the tiny Qwen2.5-VL, checkpoint at the end."""
    tmp = tmp_path_factory.mktemp("train")
    cfg = tiny_train_config(tmp, training={"per_device_train_batch_size": 1, "max_steps": 2})
    done = run_cli("train-ab", str(write_config(tmp / "train.yaml", cfg)), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


def _image() -> Image.Image:
    image = Image.new("RGB", (112, 140), (240, 240, 240))
    ImageDraw.Draw(image).rectangle((20, 30, 80, 100), fill=(200, 20, 20))
    return image


def plain_transformers_greedy(model_dir: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy answer ids) with nothing but transformers: the checkpoint's tokenizer, chat
    template and image processor, one `<|image_pad|>` per merged patch and the image-token mask (what
    Qwen2.5-VL's processor does), `generate` with the checkpoint's generation config."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pixels = processor(images=[_image()], return_tensors="pt")
    num_pads = int(pixels["image_grid_thw"][0].prod()) // processor.merge_size**2
    text = text.replace("<|image_pad|>", "<|image_pad|>" * num_pads)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    # What Qwen2.5-VL's processor returns next to the ids (transformers 5 computes the multimodal rotary
    # positions from it; the processor itself needs torchvision for its video half).
    ids["mm_token_type_ids"] = (ids["input_ids"] == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(**ids, **pixels, max_new_tokens=MAX_TOKENS, do_sample=False)
    answer = out[0, ids["input_ids"].shape[1] :].tolist()
    eos = model.generation_config.eos_token_id
    stops = {eos} if isinstance(eos, int) else set(eos)
    cut = next((k + 1 for k, t in enumerate(answer) if t in stops), len(answer))
    return ids["input_ids"][0].tolist(), answer[:cut]


def stagectl_greedy(model_dir: Path) -> tuple[list[int], list[int]]:
    """The same through stagectl's loading, prompt encoding and generation (what rollouts use)."""
    bundle = load_bundle(str(model_dir))
    prompt = encode_prompt(bundle.tokenizer, bundle.require_image_processor(), [_image()], INSTRUCTION)
    pad = int(bundle.tokenizer.pad_token_id)
    (generation,) = generate_batch(
        bundle.model,
        [prompt],
        SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0),
        stop_token_ids=bundle.stop_token_ids,
        pad_token_id=pad,
    )
    return prompt.input_ids, generation.token_ids


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_checkpoint_model_reloads_in_plain_transformers_with_the_same_greedy_ids(run_dir: Path) -> None:
    model_dir = run_dir / "checkpoint-2" / "model"
    plain = plain_transformers_greedy(model_dir)
    assert plain == stagectl_greedy(model_dir)
    assert len(plain[1]) > 0
    base = _tensors(resolve_model_path(BASE))
    trained = _tensors(model_dir)
    assert any(not torch.equal(base[name], trained[name]) for name in base)  # it is the trained model


def test_checkpoint_model_has_the_base_layout_plus_coordinate_tokens(run_dir: Path) -> None:
    model_dir = run_dir / "checkpoint-2" / "model"
    assert {p.name for p in model_dir.iterdir()} == MODEL_FILES
    base = _tensors(resolve_model_path(BASE))
    trained = _tensors(model_dir)
    # Same names and shapes as the base checkpoint: whatever loads the base (vLLM's weight mapper
    # included) loads this one. The names are the hub layout (model.layers..., visual..., lm_head).
    assert {n: t.shape for n, t in trained.items()} == {n: t.shape for n, t in base.items()}
    assert "lm_head.weight" in trained and any(n.startswith("visual.") for n in trained)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["use_cache"] is True  # the learner trains without a KV cache; the saved model has it
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert config["text_config"]["vocab_size"] >= len(tokenizer)
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    assert all(coord_token(k) in added and not added[coord_token(k)].special for k in range(1000))


def test_export_writes_a_clean_model_to_publish(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "published"
    done = run_cli("export", str(run_dir), str(out), timeout=300)  # a run dir: its newest checkpoint
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint-2/model (qwen2_5_vl, float32, coordinate tokens at ids" in done.stdout
    assert {p.name for p in out.iterdir()} == {*MODEL_FILES, "README.md"}
    source = run_dir / "checkpoint-2" / "model"
    exported, saved = _tensors(out), _tensors(source)
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert "is_local" not in tokenizer_config and "local_files_only" not in tokenizer_config
    card = (out / "README.md").read_text()
    assert "`<|coord_0|>`..`<|coord_999|>`" in card and "AutoModelForImageTextToText" in card
    assert plain_transformers_greedy(out) == plain_transformers_greedy(source)

    again = run_cli("export", str(run_dir / "checkpoint-2"), str(out), timeout=300)
    assert again.returncode == 1
    assert again.stderr.strip() == f"error: {out} exists and is not an empty directory; choose a new path"

    half = tmp_path / "bf16"
    done = run_cli("export", str(run_dir / "checkpoint-2"), str(half), "--dtype", "bf16", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in _tensors(half).values()} == {torch.bfloat16}


def test_export_adds_coordinate_tokens_for_a_vllm_detection_base(tmp_path: Path) -> None:
    llama = resolve_model_path("builtin:tiny-llama3")
    args = dict(model_name="m", dtype="float32", max_batch_size=1, batch_wait_ms=1.0, coord_tokens=True)
    with pytest.raises(ValueError, match="--add-coord-tokens"):  # the vllm engine cannot add tokens itself
        VllmEngine(llama, VllmEngineArgs(), **args)  # type: ignore[arg-type]
    out = tmp_path / "llama-coord"
    umask = os.umask(0o022)  # the export inherits it: a directory others (vLLM, jobs) can read
    try:
        done = run_cli("export", "builtin:tiny-llama3", str(out), "--add-coord-tokens", timeout=300)
    finally:
        os.umask(umask)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stat.S_IMODE(out.stat().st_mode) == 0o755  # not mkdtemp's 0700
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    bundle = load_bundle(str(out), add_coord_tokens=False)  # loaded as it is on disk
    assert len(bundle.coord_token_ids) == 1000
    assert bundle.model.config.vocab_size >= len(bundle.tokenizer) > 1000
    assert bundle.tokenizer.convert_ids_to_tokens(bundle.end_of_turn_id) == "<|eot_id|>"
    # The coordinate check passes now; what stops this engine here is only the missing vllm package.
    with pytest.raises(ValueError, match="needs the vllm package"):
        VllmEngine(out, VllmEngineArgs(), **args)  # type: ignore[arg-type]
