"""The vllm engine's checks that need no vLLM: what a full sync must send to a vision-language model (the
learner's `state_dict()` names, not the older names Qwen2.5-VL files keep), and why torchvision does not
import (the reason a vision-language model is refused)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagectl.engines.interface import TensorSpec
from stagectl.engines.vllm import checkpoint_specs, learner_specs, torchvision_problem
from stagectl.models.loading import load_bundle, load_model_config, resolve_model_path


def test_specs_of_a_qwen25_vl_checkpoint_are_the_learners_names() -> None:
    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    specs = learner_specs(path, load_model_config(path), "bfloat16")
    learner = load_bundle("builtin:tiny-qwen2.5-vl").model.state_dict()
    assert specs == {name: TensorSpec(tuple(t.shape), "bfloat16") for name, t in learner.items()}
    on_disk = checkpoint_specs(path, "bfloat16")
    assert "visual.patch_embed.proj.weight" in on_disk  # the file keeps the older names...
    assert "model.visual.patch_embed.proj.weight" in specs  # ...the learner pushes the model's own


def test_a_checkpoint_whose_tensors_do_not_fit_its_config_is_refused(tmp_path: Path) -> None:
    source = resolve_model_path("builtin:tiny-qwen2")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"do not match the \d+ of the model config\.json describes"):
        learner_specs(tmp_path, load_model_config(tmp_path), "float32")


def _fake_torchvision(root: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "torchvision").mkdir()
    (root / "torchvision" / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)


def test_a_torchvision_built_for_another_torch_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what PyPI's torchvision does beside a +cpu torch: a RuntimeError, not an ImportError
    _fake_torchvision(
        tmp_path, 'raise RuntimeError("operator torchvision::nms does not exist")\n', monkeypatch
    )
    assert torchvision_problem() == "RuntimeError: operator torchvision::nms does not exist"


def test_an_importable_torchvision_is_no_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_torchvision(tmp_path, "VERSION = 1\n", monkeypatch)
    assert torchvision_problem() is None


def test_a_missing_torchvision_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import of it raises ModuleNotFoundError
    problem = torchvision_problem()
    assert problem is not None and problem.startswith("ModuleNotFoundError")
    assert "\n" not in problem  # one line inside the refusal message
