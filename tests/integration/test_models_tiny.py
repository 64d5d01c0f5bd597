"""The tiny models: build, cache (locking, rebuild on recipe change), load, and the real-checkpoint path."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from stagectl.models import tiny
from stagectl.models.loading import load_bundle, load_tokenizer, resolve_model_path
from stagectl.models.tokenizer import NUM_COORD_BINS, build_tiny_tokenizer, coord_token, token_bytes_table

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # On a shared 2-core machine, torch's 2 intra-op threads oversubscribe the CPU and run ~30x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(embedding: Any) -> int:
    return int(embedding.weight.shape[0])


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STAGECTL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "qwen2-vl", "qwen3-vl", "qwen2"])
def test_builtin_loads_through_the_cache_and_generates(arch: str, cache_dir: Path) -> None:
    bundle = load_bundle(f"builtin:tiny-{arch}")
    assert bundle.path == cache_dir / f"tiny-{arch}"
    assert json.loads((bundle.path / tiny.RECIPE_FILE).read_text())["arch"] == arch
    assert bundle.model.config.get_text_config().hidden_size == 128
    if arch == "qwen2":  # text-only: no image processor, and saying so where one is needed
        assert bundle.image_processor is None
        with pytest.raises(ValueError, match="text-only"):
            bundle.require_image_processor()
    else:
        assert bundle.require_image_processor() is bundle.image_processor
    assert len(bundle.coord_token_ids) == NUM_COORD_BINS
    assert bundle.tokenizer.decode([bundle.end_of_turn_id]) == "<|im_end|>"
    assert _rows(bundle.model.get_input_embeddings()) >= len(bundle.tokenizer)
    assert not bundle.model.training
    ids = torch.tensor([bundle.tokenizer.encode("Detect every object")])
    out = bundle.model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)  # type: ignore[operator]
    assert out.shape == (1, ids.shape[1] + 4)


def test_builds_are_identical(tmp_path: Path) -> None:
    a = tiny.build_tiny_model("qwen2.5-vl", tmp_path / "a")
    b = tiny.build_tiny_model("qwen2.5-vl", tmp_path / "b")
    for name in ["model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_cache_is_built_once_under_concurrency(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real_build = tiny.build_tiny_model

    def counting_build(arch: tiny.TinyArch, out_dir: str | Path) -> Path:
        calls.append(Path(out_dir))
        return real_build(arch, out_dir)

    monkeypatch.setattr(tiny, "build_tiny_model", counting_build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(tiny.resolve_builtin("builtin:tiny-qwen2-vl")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [cache_dir / "tiny-qwen2-vl"] * 3
    assert len(calls) == 1  # the others waited on the lock and found the published build
    assert sorted(p.name for p in cache_dir.iterdir()) == ["tiny-qwen2-vl", "tiny-qwen2-vl.lock"]
    # A later call is a pure cache hit.
    assert tiny.resolve_builtin("builtin:tiny-qwen2-vl") == cache_dir / "tiny-qwen2-vl"
    assert len(calls) == 1


def test_outdated_cache_is_rebuilt(cache_dir: Path) -> None:
    path = tiny.resolve_builtin("builtin:tiny-qwen2.5-vl")
    (path / tiny.RECIPE_FILE).write_text(json.dumps({"arch": "qwen2.5-vl", "recipe_version": 0}))
    (path / "junk").write_text("old build")
    assert tiny.resolve_builtin("builtin:tiny-qwen2.5-vl") == path
    assert not (path / "junk").exists()
    assert json.loads((path / tiny.RECIPE_FILE).read_text())["recipe_version"] == tiny.RECIPE_VERSION


def test_bad_names_and_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("builtin:tiny-qwen2.5-vl")):
        resolve_model_path("builtin:tiny-llama")
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_bundle(str(missing))
    with pytest.raises(ValueError, match=re.escape("no config.json")):
        load_tokenizer(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ValueError, match=r"cannot load this checkpoint .* runs no remote code"):
        load_bundle(str(tmp_path))


def test_checkpoint_without_coord_tokens_gets_them(tmp_path: Path) -> None:
    # A stand-in for a stock Qwen checkpoint: same layout, no coordinate tokens, embeddings sized to fit.
    tokenizer = build_tiny_tokenizer(with_coord_tokens=False)
    config = tiny.tiny_config("qwen2.5-vl", tokenizer)
    config.text_config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = tiny.Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    tiny.build_image_processor(14).save_pretrained(tmp_path)
    assert coord_token(5) not in tokenizer.get_vocab()

    bundle = load_bundle(str(tmp_path))
    assert len(bundle.tokenizer) == len(tokenizer) + NUM_COORD_BINS
    assert _rows(bundle.model.get_input_embeddings()) >= len(bundle.tokenizer)
    assert _rows(bundle.model.get_output_embeddings()) >= len(bundle.tokenizer)
    ids = bundle.tokenizer.encode(f'["{coord_token(5)}"]', add_special_tokens=False)
    assert bundle.coord_token_ids[5] in ids
    table = token_bytes_table(bundle.tokenizer)
    assert table[bundle.coord_token_ids[5]] == coord_token(5).encode()


CLI = [sys.executable, "-c", "from stagectl.cli.app import main; main()"]


def test_cli_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "m"
    done = subprocess.run(
        [*CLI, "tiny-model", str(out), "--arch", "qwen3-vl"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote tiny qwen3-vl model to {out}" in done.stdout
    assert load_bundle(str(out)).model.config.model_type == "qwen3_vl"
    again = subprocess.run([*CLI, "tiny-model", str(out)], capture_output=True, text=True)
    assert again.returncode == 1
    assert again.stderr.strip() == f"error: {out} exists and is not an empty directory; choose a new path"
    bad = subprocess.run(
        [*CLI, "tiny-model", str(tmp_path / "x"), "--arch", "llama"], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        "error: --arch 'llama' is not one of qwen2.5-vl, qwen2-vl, qwen3-vl, qwen2, llama3, qwen3, gemma3"
    )


def test_text_only_model_shape() -> None:
    tokenizer = build_tiny_tokenizer()
    config = tiny.tiny_config("qwen2", tokenizer)
    assert config.model_type == "qwen2" and not config.tie_word_embeddings  # vLLM-CPU-safe untied head
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tokenizer)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 2, 2)
    assert config.hidden_size // config.num_attention_heads == 64  # head_dim
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
