"""`export_model` of a train-ab checkpoint whose model/ is stored in bf16 beside its float32 master weights:
`--dtype float32` writes the masters (it widened model/'s bf16-rounded values and called them float32)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText

from stagectl.models.export import MASTER_WEIGHTS, SHARDED_STATE, export_model
from stagectl.models.loading import TRAINER_STATE, load_bundle


def _bf16_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """checkpoint-2/ as a ddp bf16-storage run writes it; returns the masters."""
    bundle = load_bundle("builtin:tiny-qwen2.5-vl", torch_dtype="float32")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in bundle.model.parameters():  # values bf16 cannot hold
            param.add_(torch.randn(param.shape, generator=generator) * 1e-3)
    masters = {k: v.clone() for k, v in bundle.model.state_dict().items()}
    path.mkdir(parents=True)
    save_file(masters, str(path / MASTER_WEIGHTS))
    bundle.model.to(torch.bfloat16).save_pretrained(path / "model")
    bundle.tokenizer.save_pretrained(path / "model")
    assert bundle.image_processor is not None
    bundle.image_processor.save_pretrained(path / "model")
    (path / TRAINER_STATE).write_text("{}")
    return masters


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def test_a_float32_export_of_a_bf16_checkpoint_holds_its_master_weights(tmp_path: Path) -> None:
    masters = _bf16_checkpoint(tmp_path / "run" / "checkpoint-2")
    wide = export_model(str(tmp_path / "run"), tmp_path / "fp32", torch_dtype="float32")
    assert wide.from_masters and wide.dtype == "float32"
    exported = _weights(tmp_path / "fp32")
    assert all(torch.equal(exported[k], masters[k]) for k in masters)
    as_saved = export_model(str(tmp_path / "run"), tmp_path / "bf16")  # model/'s own dtype: model/ itself
    assert not as_saved.from_masters and as_saved.dtype == "bfloat16"
    stored = _weights(tmp_path / "bf16")
    assert any(
        not torch.equal(stored[k], masters[k]) for k in masters
    )  # bf16 rounding: what fp32 must not be


def test_a_float32_export_of_an_fsdp_checkpoint_holds_its_sharded_master_weights(tmp_path: Path) -> None:
    """fsdp keeps the masters as DCP shards in train_state/ (`{"model": ..., "optim": ...}`): `--dtype float32`
    widened model/'s bf16 values. Written here by one process, as the ranks' shards read back."""
    import warnings

    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "run" / "checkpoint-2"
    masters = _bf16_checkpoint(checkpoint)
    (checkpoint / MASTER_WEIGHTS).unlink()  # fsdp writes no such file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": masters}, storage_writer=dcp.FileSystemWriter(str(checkpoint / SHARDED_STATE)))
    wide = export_model(str(checkpoint), tmp_path / "fp32", torch_dtype="float32")
    assert wide.from_masters
    exported = _weights(tmp_path / "fp32")
    assert all(torch.equal(exported[k], masters[k]) for k in masters)


def test_shards_without_every_weight_are_refused_not_half_applied(tmp_path: Path) -> None:
    import warnings

    import pytest
    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "run" / "checkpoint-2"
    masters = _bf16_checkpoint(checkpoint)
    (checkpoint / MASTER_WEIGHTS).unlink()
    first = next(iter(masters))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"model": {k: v for k, v in masters.items() if k != first}},
            storage_writer=dcp.FileSystemWriter(str(checkpoint / SHARDED_STATE)),
        )
    with pytest.raises(ValueError, match=f"do not hold 1 of model/'s weights .e.g. {first}"):
        export_model(str(checkpoint), tmp_path / "fp32", torch_dtype="float32")
    assert not (tmp_path / "fp32").exists()


def test_export_reads_the_file_names_the_learner_writes() -> None:
    """models.export keeps its own copies of the names (it must not import the learner); a rename there
    would make export fall back to widening model/ without a word."""
    from stagectl.learner import checkpoint

    assert (MASTER_WEIGHTS, SHARDED_STATE) == (checkpoint.MASTER_WEIGHTS, checkpoint.SHARDED_STATE)
