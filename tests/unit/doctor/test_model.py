"""`stagectl doctor`'s model checks and the packed-vs-unpacked forward on the tiny Qwen2.5-VL: each made to
fail on purpose (a checkpoint without a chat template, a text-only model, a pack whose positions do not
restart) and its line read back."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from stagectl import collate
from stagectl.config import StagectlConfig, load_config
from stagectl.config.plan_server import learner_servers
from stagectl.data.synthetic import generate_synthetic
from stagectl.detection.vocab import TokenVocab
from stagectl.doctor.data_checks import sample_lengths
from stagectl.doctor.model_checks import _coord_tokens, check_tokenizer, load_model
from stagectl.doctor.packing_check import check_packed_forward
from stagectl.learner.segments import SampleEncoder
from stagectl.models.loading import ModelBundle, load_bundle, resolve_model_path
from stagectl.models.tokenizer import build_tiny_tokenizer

TINY = "builtin:tiny-qwen2.5-vl"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_bundle(TINY)


def _cfg(tmp_path: Path, **sections: Any) -> StagectlConfig:
    raw: dict[str, Any] = {
        "model": {"name_or_path": TINY},
        "data": {"synthetic": {"num_samples": 12, "seed": 0, "image_size": 112, "max_objects": 2}},
        "global_max_length": 512,
        "training": {"output_dir": str(tmp_path / "run")},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step"}},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path, world_size=1)


def test_tokenizer_checks_pass_on_the_tiny_model(tmp_path: Path) -> None:
    loadable, (chat, coords) = check_tokenizer(_cfg(tmp_path).model, None)
    assert loadable
    assert chat.status == "ok" and chat.message.startswith("end of turn <|im_end|> (")
    assert "rollouts stop at <|im_end|>" in chat.message
    assert coords.status == "ok" and coords.message.startswith("<|coord_0|>..<|coord_999|> present")


def test_a_checkpoint_without_chat_template_fails(tmp_path: Path) -> None:
    broken = tmp_path / "no-template"
    shutil.copytree(resolve_model_path(TINY), broken)
    (broken / "chat_template.jinja").unlink()
    loadable, (line,) = check_tokenizer(_cfg(tmp_path, model={"name_or_path": str(broken)}).model, None)
    assert not loadable
    assert line.name == "model.chat_template" and line.status == "fail"
    assert "the tokenizer has no chat template" in line.message and "instruct" in line.fix


def test_missing_coordinate_tokens_warn_or_fail_where_a_server_needs_them(tmp_path: Path) -> None:
    without = build_tiny_tokenizer(with_coord_tokens=False)
    in_learner = learner_servers(_cfg(tmp_path)).rollout_engine
    assert in_learner is None
    line = _coord_tokens(TINY, in_learner, without)
    assert line.status == "warn" and "tokenizer lacks 1000 coordinate tokens" in line.message
    rollouts = {
        "rollout_backend": "vllm",
        "vllm": {"server": {"servers": [{"base_url": "http://127.0.0.1:9"}]}},
    }
    vllm_server = _cfg(
        tmp_path, custom={"extra": {"rollout_matching": rollouts}}, rollout_server={"engine": "vllm"}
    )
    line = _coord_tokens(TINY, learner_servers(vllm_server).rollout_engine, without)
    assert line.status == "fail" and "a vLLM rollout server" in line.message
    assert "--add-coord-tokens" in line.fix


def test_model_load_fails_on_a_missing_or_text_only_model(tmp_path: Path) -> None:
    loadable, (line,) = check_tokenizer(
        _cfg(tmp_path, model={"name_or_path": str(tmp_path / "nope")}).model, None
    )
    assert not loadable and line.name == "model.load" and line.status == "fail"
    assert "model directory not found" in line.message
    # refused from its files, before a weight loads (train-ab's own rule): the tokenizer lines still come
    loadable, lines = check_tokenizer(
        _cfg(tmp_path, model={"name_or_path": "builtin:tiny-qwen2"}).model, None
    )
    assert not loadable and [line.name for line in lines] == [
        "model.chat_template",
        "model.coord_tokens",
        "model.load",
    ]
    assert lines[-1].status == "fail" and "is a text-only qwen2 model" in lines[-1].message
    bundle, line = load_model(_cfg(tmp_path).model, "cpu")
    assert bundle is not None and line.status == "ok" and "qwen2_5_vl from" in line.message


def test_sample_lengths_equal_the_learners(bundle: ModelBundle) -> None:
    # two image sizes: the prompt length is computed once per size
    samples = generate_synthetic(6, 0, image_size=112) + generate_synthetic(6, 1, image_size=168)
    encoder = SampleEncoder(bundle=bundle, samples=samples, vocab=TokenVocab.from_tokenizer(bundle.tokenizer))
    expected = [encoder.channel_a_length(i) for i in range(len(samples))]
    assert sample_lengths(bundle, samples) == expected
    assert len(encoder.prompt(0).input_ids) < len(encoder.prompt(6).input_ids)  # the sizes' prompts differ


def _pack(tmp_path: Path, bundle: ModelBundle, **sections: Any) -> tuple[StagectlConfig, list, list[int]]:
    cfg = _cfg(tmp_path, **sections)
    assert cfg.data is not None and cfg.data.synthetic is not None
    samples = generate_synthetic(12, 0, image_size=112, max_objects=2)
    return cfg, samples, sample_lengths(bundle, samples)


def test_packed_forward_equals_unpacked(tmp_path: Path, bundle: ModelBundle) -> None:
    cfg, samples, lengths = _pack(tmp_path, bundle)
    line = check_packed_forward(cfg.global_max_length, cfg.training, bundle, samples, lengths)
    assert line.status == "ok", line
    assert "samples," in line.message and "of 512 tokens" in line.message
    num_samples = int(line.message.split("on a pack of ")[1].split(" samples")[0])
    assert num_samples >= 2  # a real pack: several segments share the sequence


def _positions_do_not_restart(real: Any) -> Any:
    """collate_pack with the packed-position-id bug: text positions run on across segments."""

    def broken(segments: Any, model: Any) -> collate.PackedBatch:
        batch = real(segments, model)
        assert batch.position_ids is not None
        batch.position_ids[0, 0] = torch.arange(batch.position_ids.shape[-1])
        return batch

    return broken


def test_packed_forward_catches_positions_that_do_not_restart(
    tmp_path: Path, bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, samples, lengths = _pack(tmp_path, bundle)
    monkeypatch.setattr(collate, "collate_pack", _positions_do_not_restart(collate.collate_pack))
    line = check_packed_forward(cfg.global_max_length, cfg.training, bundle, samples, lengths)
    assert line.status == "fail" and line.name == "packing.forward"
    assert line.message.startswith("packed logits differ from unpacked ones by ")
    assert "segments leak into each other" in line.message and "training.packing: false" in line.fix
    # with packing off training never reads a pack: a warning, not a failure
    cfg, samples, lengths = _pack(tmp_path, bundle, training={"packing": False})
    assert (
        check_packed_forward(cfg.global_max_length, cfg.training, bundle, samples, lengths).status == "warn"
    )
