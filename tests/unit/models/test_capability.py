"""`detection_model_problem`: what train-ab needs of a checkpoint (a Qwen-VL config with a vision tower, and
its image processor), read from the files alone; `model_problem_on_disk` leaves a model that is not on disk
yet to the rank that builds it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stagectl.models.capability import detection_model_problem, model_problem_on_disk


def _checkpoint(path: Path, config: dict[str, Any], *, image_processor: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if image_processor:
        (path / "preprocessor_config.json").write_text("{}")
    return path


@pytest.mark.parametrize(
    ("config", "image_processor", "expected"),
    [
        ({"model_type": "qwen2_5_vl", "vision_config": {}}, True, None),
        ({"model_type": "qwen3_vl", "vision_config": {}}, True, None),
        ({"model_type": "qwen3"}, False, "is a text-only qwen3 model (config.json has no vision_config)"),
        ({"model_type": "llava", "vision_config": {}}, True, "is a llava vision-language model: train-ab"),
        ({"model_type": "qwen2_vl", "vision_config": {}}, False, "has no preprocessor_config.json"),
    ],
)
def test_detection_model_problem(
    tmp_path: Path, config: dict[str, Any], image_processor: bool, expected: str | None
) -> None:
    problem = detection_model_problem(_checkpoint(tmp_path / "ckpt", config, image_processor=image_processor))
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem and str(tmp_path / "ckpt") in problem


def test_the_builtin_models_are_told_apart(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The built-in tiny models' cache entries: the text-only ones are refused, the Qwen-VL ones pass; one
    not built yet is left to the rank (None), which builds it and asks again."""
    monkeypatch.setenv("STAGECTL_CACHE_DIR", str(tmp_path))
    models = tmp_path / "models"
    _checkpoint(models / "tiny-qwen3", {"model_type": "qwen3"}, image_processor=False)
    _checkpoint(models / "tiny-qwen2.5-vl", {"model_type": "qwen2_5_vl", "vision_config": {}})
    assert "text-only qwen3" in (model_problem_on_disk("builtin:tiny-qwen3") or "")
    assert model_problem_on_disk("builtin:tiny-qwen2.5-vl") is None
    assert model_problem_on_disk("builtin:tiny-qwen3-vl") is None  # not built yet
    assert model_problem_on_disk(str(tmp_path / "nowhere")) is None  # the rank names the missing directory


def test_a_chat_template_that_does_not_compile_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """A checkpoint whose chat template has a Jinja syntax error failed at the first step, after the model
    had loaded, with a traceback; it is refused from its files now, naming the file and the line. Templates
    transformers compiles (its loop controls, its `generation` tag) pass."""
    config = {"model_type": "qwen2_5_vl", "vision_config": {}}
    jinja = _checkpoint(tmp_path / "jinja", config)
    (jinja / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}\n{% if %}{% endfor %}")
    assert detection_model_problem(jinja) == (
        f"{jinja / 'chat_template.jinja'}: the chat template does not compile (line 2): "
        "Expected an expression, got 'end of statement block'"
    )
    in_config = _checkpoint(tmp_path / "in-config", config)
    (in_config / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0] "}))
    problem = detection_model_problem(in_config)
    assert problem is not None
    assert problem.startswith(f"{in_config / 'tokenizer_config.json'}: the chat template does not compile")
    valid = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    (jinja / "chat_template.jinja").write_text(valid)
    assert detection_model_problem(jinja) is None
