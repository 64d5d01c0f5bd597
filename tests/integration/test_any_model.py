"""Any chat checkpoint, not just Qwen-VL: tiny random-initialised Llama 3, Qwen3, Gemma 3, Qwen2.5-VL and
Qwen3-VL models (real chat templates, stop ids read from each checkpoint) load unchanged through the
Auto classes, the `hf` rollout server answers `/infer/` and stops exactly at each family's end-of-turn,
Stage-B judges a batch and reflects with each of them, and text models pack with packed = unpacked
logits. A Stage-B run that cannot load its model leaves no artifacts behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from stagectl.collate import Segment, collate_pack
from stagectl.config import load_config
from stagectl.config.plan_server import server_plan
from stagectl.config.plan_stage_b import stage_b_plan
from stagectl.engines.hf import HFEngine
from stagectl.models.loading import load_bundle
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer, build_engine
from stagectl.stage_b.runner import StartUpError, run_all
from tests.integration.any_model import (
    ARCHS,
    END_OF_TURN,
    JUDGE_ANSWER,
    MISSION,
    RULE,
    STOPS,
    TEXT_ARCHS,
    VL_ARCHS,
    Planted,
    infer_body,
    plant_end_of_turn,
    stage_b_inputs,
    train_judge,
)
from tests.integration.helpers import run_cli

pytestmark = pytest.mark.integration

SAVED_TOKENIZER_LENGTHS = {"llama3": 765, "qwen3": 772, "gemma3": 1287}  # no coordinate tokens


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # On a shared 2-core machine, torch's 2 intra-op threads oversubscribe the CPU and run ~30x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Planted]:
    root = tmp_path_factory.mktemp("planted")
    return {arch: plant_end_of_turn(arch, root / arch) for arch in ARCHS}


# ------------------------------------------------------------------ loading


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_unchanged_through_the_auto_classes(arch: str) -> None:
    bundle = load_bundle(f"builtin:tiny-{arch}", add_coord_tokens=False)
    tokenizer = bundle.tokenizer
    saved_vocab = json.loads((bundle.path / "config.json").read_text())
    rows = bundle.model.get_input_embeddings().weight.shape[0]
    assert rows == (saved_vocab.get("text_config") or saved_vocab)["vocab_size"]  # nothing resized
    assert tokenizer.convert_ids_to_tokens(bundle.end_of_turn_id) == END_OF_TURN[arch]
    assert set(tokenizer.convert_ids_to_tokens(bundle.stop_token_ids)) == STOPS[arch]
    if arch in VL_ARCHS:
        assert bundle.vision_language and type(bundle.model).__name__.endswith("ForConditionalGeneration")
        assert bundle.require_image_processor() is bundle.image_processor
    else:
        assert len(tokenizer) == SAVED_TOKENIZER_LENGTHS[arch]
        assert bundle.coord_ids is None and type(bundle.model).__name__.endswith("ForCausalLM")
        with pytest.raises(ValueError, match="no coordinate tokens"):
            _ = bundle.coord_token_ids
        with pytest.raises(ValueError, match="text-only"):
            bundle.require_image_processor()


def test_detection_loading_adds_coordinate_tokens_to_any_model() -> None:
    bundle = load_bundle("builtin:tiny-llama3", add_coord_tokens=True)
    assert len(bundle.tokenizer) == SAVED_TOKENIZER_LENGTHS["llama3"] + 1000
    assert bundle.model.get_input_embeddings().weight.shape[0] >= len(bundle.tokenizer)
    assert len(bundle.coord_token_ids) == 1000
    assert bundle.tokenizer.convert_ids_to_tokens(bundle.end_of_turn_id) == "<|eot_id|>"


# ------------------------------------------------------------------ the hf rollout server


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_server_answers_and_stops_at_the_end_of_turn(arch: str, planted: dict[str, Planted]) -> None:
    plant = planted[arch]
    cfg = load_config(None, [f"model.name_or_path={plant.path}", "rollout_server.max_batch_size=2"])
    engine = build_engine(
        server_plan(cfg)
    )  # what `stagectl rollout-server --model DIR` builds: a plain serving config
    assert isinstance(engine, HFEngine)
    assert engine.bundle.coord_ids is None or arch in VL_ARCHS  # plain serving adds no tokens
    server = ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start()
    try:
        response = httpx.post(f"{server.url}/infer/", json=infer_body(arch), timeout=120)
    finally:
        server.stop()
    assert response.status_code == 200, response.text
    (item,) = [entry["response"] for entry in response.json()]  # swift's RolloutOutput shape
    choice = item["choices"][0]
    # The planted answer: k ordinary tokens, then the end-of-turn; nothing after it.
    assert choice["token_ids"] == plant.expected
    assert choice["finish_reason"] == "stop"
    tokenizer = engine.bundle.tokenizer
    assert choice["message"]["content"] == tokenizer.decode(plant.expected, skip_special_tokens=True)
    if arch == "llama3":  # <|eot_id|> is a stop only because the chat template says so
        generation_config = json.loads((plant.path / "generation_config.json").read_text())
        assert plant.end_of_turn_id != generation_config["eos_token_id"]


# ------------------------------------------------------------------ Stage-B


def _stage_b_config(root: Path, model: str) -> Any:
    tickets, guidance = stage_b_inputs(root)
    raw = {
        "model": {"name_or_path": model},
        "mission": MISSION,
        "tickets": [str(tickets)],
        "guidance": {"path": str(guidance)},
        "output": {"root": str(root / "out"), "run_name": "r"},
        "sampler": {"grid": [{"temperature": 0.0, "max_new_tokens": 48}], "samples_per_decode": 1},
        "runner": {"engine": "model", "epochs": 1, "per_rank_rollout_batch_size": 3},
        "reflection": {"batch_size": 1, "max_operations": 2, "max_new_tokens": 96},
    }
    (root / "stage_b.yaml").write_text(yaml.safe_dump(raw))
    return load_config(root / "stage_b.yaml", [])


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("arch", ARCHS)
def test_stage_b_judges_a_batch_and_reflects(arch: str, tmp_path: Path) -> None:
    tickets, guidance = stage_b_inputs(tmp_path)
    judge = train_judge(arch, tickets, guidance, tmp_path / "judge")
    cfg = _stage_b_config(tmp_path, str(judge))
    summary = run_all(stage_b_plan(cfg))
    assert summary is not None and summary.num_judged == 3
    run_dir = tmp_path / "out" / "r" / MISSION
    trajectories = _rows(run_dir / "trajectories.jsonl")
    # Each answer ends at the family's end-of-turn: exactly the two lines, so every verdict parses.
    assert [t["text"] for t in trajectories] == [JUDGE_ANSWER] * 3
    assert all(t["verdict"] == "fail" and t["format_error"] is None for t in trajectories)
    (reflection,) = _rows(run_dir / "reflection.jsonl")  # g2::pass was judged fail
    assert reflection["records"] == ["g2::pass"] and reflection["changed"]
    assert [op["text"] for op in reflection["accepted"]] == [RULE]
    final = json.loads((run_dir / "guidance.json").read_text())
    assert final["step"] == 1 and RULE in final["experiences"].values()


def test_stage_b_that_cannot_load_its_model_writes_nothing(tmp_path: Path) -> None:
    cfg = _stage_b_config(tmp_path, str(tmp_path / "no-such-model"))
    # every rank fails to load it alike: a start-up error, which rank 0 alone reports
    with pytest.raises(StartUpError, match="model directory not found"):
        run_all(stage_b_plan(cfg))
    assert not (tmp_path / "out").exists()
    # The CLI says the same in one line and exits 1, still without artifacts.
    done = run_cli("stage-b", str(tmp_path / "stage_b.yaml"), timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: model directory not found")
    assert not (tmp_path / "out").exists()


def test_stage_b_model_that_is_not_a_checkpoint_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    cfg = _stage_b_config(tmp_path, str(tmp_path / "broken"))
    with pytest.raises(ValueError, match="cannot load this checkpoint"):
        run_all(stage_b_plan(cfg))
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ packing text models

TEXTS = [
    "Verdict: fail\nReason: the label is missing.",
    "The image shows a small blue square on the left and a large green triangle on the right.",
    "There are no objects in this image.",
]
ATOL = 1e-4


def _text_segments(arch: str) -> tuple[Any, list[Segment]]:
    bundle = load_bundle(f"builtin:tiny-{arch}", add_coord_tokens=False)
    segments = []
    for text in TEXTS:
        messages = [
            {"role": "user", "content": "Describe the image."},
            {"role": "assistant", "content": text},
        ]
        ids = bundle.tokenizer.apply_chat_template(messages, tokenize=False)
        input_ids = list(bundle.tokenizer.encode(ids, add_special_tokens=False))
        n = len(input_ids)
        segments.append(Segment(input_ids, [0.0] + [1.0] * (n - 1), [0] * n, None, None))
    return bundle, segments


@pytest.mark.parametrize("arch", TEXT_ARCHS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_unpacked_for_text_models(arch: str, attn: str) -> None:
    bundle, segments = _text_segments(arch)
    model = bundle.model
    model.set_attn_implementation(attn)
    assert len({len(s) for s in segments}) == 3
    if arch == "gemma3":  # the sliding-window layer really slides inside these segments
        assert max(len(s) for s in segments) > model.config.sliding_window
    batch = collate_pack(segments, model)
    total = sum(len(s) for s in segments)
    assert batch.position_ids is not None and batch.position_ids.shape == (1, total)
    assert batch.position_ids[0, batch.segment_starts].tolist() == [0, 0, 0]
    assert "mm_token_type_ids" not in batch.model_inputs()
    with torch.no_grad():
        packed = model(**batch.model_inputs()).logits[0]
        for segment, start in zip(segments, batch.segment_starts, strict=True):
            single = model(input_ids=torch.tensor([segment.input_ids]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(segment)], single, atol=ATOL, rtol=0)
        # The test can fail: positions that do not restart let the segments attend to each other.
        broken = batch.model_inputs()
        broken["position_ids"] = torch.arange(total).view(1, -1)
        assert (model(**broken).logits[0] - packed).abs().max() > 100 * ATOL
