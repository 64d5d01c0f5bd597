"""`resolve_checkpoint`: what `stagectl export` and `stagectl eval --model` read a path as (a checkpoint, a
run's newest complete checkpoint, a model directory), and what it says when a run holds no whole one."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.models.loading import TRAINER_STATE, resolve_checkpoint, resolve_model_path


def _checkpoint(run: Path, step: int, *, complete: bool = True) -> Path:
    model = run / f"checkpoint-{step}" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    if complete:
        (model.parent / TRAINER_STATE).write_text("{}")
    return model


def test_a_run_dir_reads_as_its_newest_complete_checkpoint(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 5)
    newest = _checkpoint(tmp_path, 12)
    _checkpoint(tmp_path, 20, complete=False)  # a save a crash cut short
    assert resolve_checkpoint(str(tmp_path)) == newest  # 12, not 5 (numbers, not names) nor 20


def test_a_checkpoint_and_a_model_dir_read_as_themselves(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path, 3)
    assert resolve_checkpoint(str(model.parent)) == model
    assert resolve_checkpoint(str(model)) == model


def test_model_name_or_path_naming_a_checkpoint_run_or_adapter_says_which_model_dir_to_give(
    tmp_path: Path,
) -> None:
    """HF users give `checkpoint-N/` as the model (an HF Trainer checkpoint holds config.json there); a
    train-ab one keeps it in model/. train-ab, rollout-server and doctor said only `no config.json`."""
    model = _checkpoint(tmp_path / "run", 4)
    with pytest.raises(ValueError, match=f"train-ab checkpoint, whose weights are in {model}: give that"):
        resolve_model_path(str(model.parent))
    with pytest.raises(
        ValueError, match=f"train-ab run directory, whose newest checkpoint's weights are in {model}"
    ):
        resolve_model_path(str(tmp_path / "run"))
    adapter = model.parent / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"LoRA adapter, and {model} beside it holds the merged weights"):
        resolve_model_path(str(adapter))
    alone = tmp_path / "lora"
    alone.mkdir()
    (alone / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="LoRA adapter: give its base model"):
        resolve_model_path(str(alone))
    with pytest.raises(ValueError, match=r"no config.json$"):
        resolve_model_path(str(tmp_path))  # nothing train-ab wrote: the plain message


def test_a_run_with_no_complete_checkpoint_says_so(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(
        ValueError, match=rf"no complete checkpoint: none of checkpoint-4 has {TRAINER_STATE}"
    ):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        resolve_checkpoint(str(tmp_path / "nowhere"))


def test_an_incomplete_checkpoint_named_directly_is_refused_as_incomplete(tmp_path: Path) -> None:
    cut = _checkpoint(tmp_path, 4, complete=False).parent
    with pytest.raises(
        ValueError, match=rf"checkpoint-4 is an incomplete checkpoint: it has no {TRAINER_STATE}"
    ) as info:
        resolve_checkpoint(str(cut))
    assert "newest complete" not in str(info.value)
    _checkpoint(tmp_path, 2)
    with pytest.raises(ValueError, match=rf"the newest complete one is in {tmp_path}$"):
        resolve_checkpoint(str(cut))


def test_a_cut_off_weight_file_is_one_error_naming_the_model_directory(tmp_path: Path) -> None:
    import shutil

    from stagectl.models.loading import DamagedWeightsError, load_bundle, resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny-qwen2.5-vl"), model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(DamagedWeightsError) as info:
        load_bundle(str(model))
    assert str(info.value) == (
        f"{model}: its weights cannot be loaded (SafetensorError: Error while deserializing header: invalid "
        "header length); a weight file is damaged or incomplete"
    )


def test_a_model_dir_without_tokenizer_files_is_refused_naming_them(tmp_path: Path) -> None:
    """transformers built a one-token tokenizer from a directory without tokenizer.json: doctor said model.load
    OK, and doctor and train-ab then failed on "vocabulary has no single token '<|im_end|>'", blaming the model."""
    import shutil

    from stagectl.models.loading import load_bundle, load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny-qwen2.5-vl"), model)
    assert len(load_tokenizer(str(model), add_coord_tokens=False)) > 1000  # whole, it loads
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    message = (
        f"{model} has no tokenizer: none of tokenizer.json, vocab.json, tokenizer.model, vocab.txt is there; "
        "copy the tokenizer files from the checkpoint it was trained from"
    )
    with pytest.raises(ValueError) as info:
        load_tokenizer(str(model), add_coord_tokens=False)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        load_bundle(str(model))
    assert str(info.value) == message
