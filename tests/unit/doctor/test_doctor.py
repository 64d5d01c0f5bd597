"""`stagectl doctor`'s checks that need no model: config, data files, box format, resources, the report.
Each check is made to fail on purpose and its line read back."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from PIL import Image

from stagectl.config import StagectlConfig, load_config
from stagectl.doctor import resource_checks
from stagectl.doctor.config_check import check_config
from stagectl.doctor.data_checks import check_box_format, check_eval_file, check_longest_sample, load_samples
from stagectl.doctor.report import Check, exit_code, fail, ok, skip, summary, to_json, warn
from stagectl.doctor.resource_checks import (
    check_disk,
    check_gpu,
    checkpoint_size,
    num_checkpoints_on_disk,
)
from stagectl.memory.estimate import TrainingKnobs
from stagectl.memory.from_config import knobs_from_config, model_shape


def _config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
        "data": {"synthetic": {"num_samples": 8, "seed": 0, "image_size": 112, "max_objects": 2}},
        "global_max_length": 512,
        "training": {"max_steps": 2, "output_dir": str(tmp_path / "run")},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step"}},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _knobs(cfg: StagectlConfig, world_size: int) -> TrainingKnobs:
    return knobs_from_config(
        cfg.model, cfg.training, global_max_length=cfg.global_max_length, world_size=world_size
    )


def _only(checks: list[Check], name: str) -> Check:
    found = [c for c in checks if c.name == name]
    assert len(found) == 1, checks
    return found[0]


# ---------------------------------------------------------------- report


def test_line_json_and_exit_code() -> None:
    checks = [ok("a", "fine"), warn("b", "odd", "look"), skip("c", "n/a")]
    assert exit_code(checks) == 0
    assert checks[1].line() == "WARN  b: odd | fix: look"
    assert checks[0].line() == "OK    a: fine"
    checks.append(fail("d", "broken", "mend it"))
    assert exit_code(checks) == 1
    assert summary(checks) == "doctor FAILED: 1 ok, 1 warn, 1 fail, 1 skip"
    data = json.loads(json.dumps(to_json(checks, 1.234)))
    assert data["ok"] is False and data["seconds"] == 1.23
    assert data["checks"][3] == {"name": "d", "status": "fail", "message": "broken", "fix": "mend it"}


# ---------------------------------------------------------------- config


def test_config_valid_for_its_world_size(tmp_path: Path) -> None:
    path = _write(tmp_path, _config(tmp_path, training={"effective_batch_size": 3}))
    cfg, lines = check_config(path, [], world_size=1)
    assert cfg is not None and lines[0].status == "ok" and "world size 1" in lines[0].message
    # the same config at the world size the run will have: one fail line per problem, each naming its key
    cfg, lines = check_config(path, [], world_size=2)
    assert cfg is None
    assert [c.status for c in lines] == ["fail", "fail"]
    assert lines[0].message.startswith("stage2_ab.channel_b.mode: 'step' runs Channel-B on one learner rank")
    assert lines[1].message.startswith("training.effective_batch_size: 3 is not a multiple")
    assert "(1 x 2 = 2)" in lines[1].message


def test_config_override_and_missing_section_fail(tmp_path: Path) -> None:
    path = _write(tmp_path, _config(tmp_path))
    _, lines = check_config(path, ["training.learnin_rate=1"], world_size=1)
    assert lines[0].status == "fail" and "training.learnin_rate" in lines[0].message
    cfg = _config(tmp_path)
    del cfg["data"]
    _, lines = check_config(_write(tmp_path, cfg), [], world_size=1)
    assert (
        lines[0].status == "fail"
        and "has no data section: doctor checks train-ab configs" in lines[0].message
    )


# ---------------------------------------------------------------- data


def _png(path: Path, size: tuple[int, int] = (112, 112)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (10, 200, 30)).save(path)


def _jsonl(tmp_path: Path, boxes: list[list[float]], images: list[str] | None = None) -> Path:
    path = tmp_path / "train.jsonl"
    images = images or [f"img/{k}.png" for k in range(len(boxes))]
    lines = [
        {"images": [image], "width": 112, "height": 112, "objects": [{"desc": "red circle", "bbox_2d": box}]}
        for image, box in zip(images, boxes, strict=True)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _data_cfg(tmp_path: Path, jsonl: Path, box_format: str = "norm1000", **data: Any) -> StagectlConfig:
    cfg = _config(tmp_path, data={"train_jsonl": str(jsonl), "box_format": box_format, **data})
    del cfg["data"]["synthetic"]
    return load_config(_write(tmp_path, cfg), world_size=1)


def test_data_file_every_image_exists_and_opens(tmp_path: Path) -> None:
    for k in range(3):
        _png(tmp_path / f"img/{k}.png")
    jsonl = _jsonl(tmp_path, [[10, 10, 500, 500]] * 3)
    samples, lines = load_samples(_data_cfg(tmp_path, jsonl).data)  # type: ignore[arg-type]
    assert samples is not None and len(samples) == 3
    assert (
        lines[0].status == "ok"
        and "3 samples, 3 images exist, open and have the lines' sizes" in lines[0].message
    )

    (tmp_path / "img/1.png").write_bytes(b"\x89PNG truncated")  # corrupt
    (tmp_path / "img/2.png").unlink()  # missing
    samples, lines = load_samples(_data_cfg(tmp_path, jsonl).data)  # type: ignore[arg-type]
    assert samples is None
    assert lines[0].status == "fail" and lines[0].name == "data.file"
    assert lines[0].message.startswith(f"{jsonl}:2: image {tmp_path / 'img/1.png'} is not a readable image")
    assert f"; {jsonl}:3: image not found: {tmp_path / 'img/2.png'}" in lines[0].message


def test_a_data_file_that_is_not_there_gets_the_fix_that_makes_one(tmp_path: Path) -> None:
    """It got the bad-lines fix ("fix or remove the lines named"), which says nothing about a missing file."""
    missing = tmp_path / "data" / "train.jsonl"
    samples, (line,) = load_samples(_data_cfg(tmp_path, missing).data)  # type: ignore[arg-type]
    assert samples is None and line.status == "fail" and line.name == "data.file"
    assert line.message == f"{missing}: no such file"
    assert line.fix.startswith("point data.train_jsonl at the file, or write it with `stagectl convert coco")
    assert f"--out {missing}`" in line.fix and "lines named" not in line.fix


def test_data_file_names_the_lines_whose_size_is_not_their_image_s(tmp_path: Path) -> None:
    """A line declaring 112x112 for a 56x56 image: every pixel box would be mis-scaled. The first bad lines
    are named (file:line, both sizes), the others counted."""
    for k in range(5):
        _png(tmp_path / f"img/{k}.png", (56, 56) if k else (112, 112))
    jsonl = _jsonl(tmp_path, [[10, 10, 50, 50]] * 5)  # every line declares 112x112
    samples, (line,) = load_samples(_data_cfg(tmp_path, jsonl, "pixel").data)  # type: ignore[arg-type]
    assert samples is None and line.status == "fail" and line.name == "data.file"
    assert re.findall(rf"{re.escape(str(jsonl))}:(\d+): ", line.message) == ["2", "3", "4"]
    assert f"image {tmp_path / 'img/1.png'} is 56x56 but the line says width 112, height 112" in line.message
    assert line.message.endswith("(and 1 more bad lines)")


def test_eval_file_is_checked_too(tmp_path: Path) -> None:
    _png(tmp_path / "img/0.png")
    jsonl = _jsonl(tmp_path, [[10, 10, 500, 500]])
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps({"images": ["img/9.png"], "width": 8, "height": 8, "objects": []}) + "\n")
    cfg = _data_cfg(tmp_path, jsonl, eval={"jsonl": str(held_out)})
    (line,) = check_eval_file(cfg.data)  # type: ignore[arg-type]
    assert line.status == "fail" and line.name == "data.eval_file"
    assert f"{held_out}:1: image not found" in line.message


def test_box_format(tmp_path: Path) -> None:
    for k in range(2):
        _png(tmp_path / f"img/{k}.png")
    # every box fits 112 x 112 pixels and norm-1000 bins alike
    both = _jsonl(tmp_path, [[10, 10, 50, 60], [1, 2, 3, 4]])
    (line,) = check_box_format(_data_cfg(tmp_path, both, "auto").data)  # type: ignore[arg-type]
    assert line.status == "fail" and "cannot tell pixel boxes from norm-1000 boxes" in line.message
    assert line.fix == "set data.box_format: pixel or norm1000"
    (line,) = check_box_format(_data_cfg(tmp_path, both, "pixel").data)  # type: ignore[arg-type]
    assert line.status == "warn" and "only box_format: pixel decides" in line.message
    assert "`stagectl convert coco` writes pixel boxes" in line.fix
    # 500 is outside a 112-pixel image: only the norm-1000 reading fits
    bins = _jsonl(tmp_path, [[10, 10, 500, 500], [1, 2, 3, 4]])
    (line,) = check_box_format(_data_cfg(tmp_path, bins, "norm1000").data)  # type: ignore[arg-type]
    assert line.status == "ok" and "unambiguously" in line.message
    (line,) = check_box_format(_data_cfg(tmp_path, bins, "pixel").data)  # type: ignore[arg-type]
    assert line.status == "fail" and line.fix == "set data.box_format: norm1000"
    fractional = _jsonl(tmp_path, [[10.5, 10, 50, 60], [1, 2, 3, 4]])
    (line,) = check_box_format(_data_cfg(tmp_path, fractional, "norm1000").data)  # type: ignore[arg-type]
    assert line.status == "fail" and line.fix == "set data.box_format: pixel"


@pytest.mark.parametrize("box_format", ["norm1000", "pixel", "auto"])
def test_box_format_never_advises_a_format_that_does_not_load_the_boxes(
    tmp_path: Path, box_format: str
) -> None:
    """A norm-1000 file with one 1000 (a typo, or Qwen2-VL's 0..1000 scale) on 112-pixel images: `auto` reads
    it as pixel, but no format loads that box; the check said "set data.box_format: pixel"."""
    for k in range(2):
        _png(tmp_path / f"img/{k}.png")
    typo = _jsonl(tmp_path, [[10, 10, 500, 1000], [10, 10, 500, 500]])
    (line,) = check_box_format(_data_cfg(tmp_path, typo, box_format).data)  # type: ignore[arg-type]
    assert line.status == "fail"
    assert line.message.startswith("1 box(es) fit neither reading") and "data.file names them" in line.fix


@pytest.mark.parametrize(
    ("box_format", "status", "message"),
    [
        ("auto", "fail", "box_format 'auto' cannot tell pixel boxes from a 0..1000 normalised scale"),
        ("pixel", "warn", "every coordinate is an integer up to 1000: pixels, or a 0..1000 normalised scale"),
        (
            "norm1000",
            "fail",
            "box_format is norm1000, but some coordinates are 1000, which is no norm-1000 bin",
        ),
    ],
)
def test_integer_boxes_up_to_1000_on_large_images_get_the_rescale_advice(
    tmp_path: Path, box_format: str, status: str, message: str
) -> None:
    """Integers up to exactly 1000 on a 2000-pixel image: pixels or a 0..1000 scale. The check advised `set
    data.box_format: pixel or norm1000` (norm1000 loads no 1000) and, under pixel, said every box fits the other
    reading (1000 is no bin) and that `convert coco` writes norm1000 (it writes pixels)."""
    _png(tmp_path / "img/0.png", (2000, 1500))
    path = tmp_path / "train.jsonl"
    line = {
        "images": ["img/0.png"],
        "width": 2000,
        "height": 1500,
        "objects": [{"desc": "car", "bbox_2d": [100, 200, 1000, 900]}],
    }
    path.write_text(json.dumps(line) + "\n")
    (check,) = check_box_format(_data_cfg(tmp_path, path, box_format).data)  # type: ignore[arg-type]
    assert (check.status, check.message.startswith(message)) == (status, True), check.message
    assert "rescaled to the norm-1000 bins 0..999" in check.fix and "pixel or norm1000" not in check.fix


def test_longest_sample_fits(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, _config(tmp_path)), world_size=1)  # global_max_length 512
    (line,) = check_longest_sample(cfg.global_max_length, [100, 512, 300])
    assert line.status == "ok" and "(index 1) has 512 tokens of 512" in line.message
    (line,) = check_longest_sample(cfg.global_max_length, [100, 600, 513])
    assert line.status == "fail"
    assert line.message.startswith("2 of 3 samples exceed global_max_length 512 (sample 1 has 600 tokens)")
    assert line.fix.startswith("set global_max_length >= 600")


# ---------------------------------------------------------------- resources


@pytest.mark.parametrize(
    ("max_steps", "save_steps", "limit", "expected"),
    # (24, 12): checkpoint-12 and checkpoint-24, the final save counted once; (25, 12): 12, 24 and 25
    [(24, 12, None, 2), (25, 12, None, 3), (24, 0, None, 1), (100, 10, 2, 3), (24, 12, 5, 2), (5, 10, 1, 1)],
)
def test_checkpoints_on_disk(max_steps: int, save_steps: int, limit: int | None, expected: int) -> None:
    cfg = StagectlConfig.model_validate(
        {"training": {"max_steps": max_steps, "save_steps": save_steps, "save_total_limit": limit}}
    )
    assert num_checkpoints_on_disk(cfg.training) == expected


def test_checkpoint_size_counts_storage_masters_and_adamw(tmp_path: Path) -> None:
    from stagectl.models.loading import resolve_model_path

    resolve_model_path("builtin:tiny-qwen2.5-vl")  # built on first use
    shape = model_shape("builtin:tiny-qwen2.5-vl")
    n = shape.counts.total
    fp32 = load_config(_write(tmp_path, _config(tmp_path)), world_size=1)
    assert checkpoint_size(shape, _knobs(fp32, 1)).total == 4 * n + 2 * 4 * n
    bf16 = load_config(
        _write(
            tmp_path,
            _config(tmp_path, model={"torch_dtype": "bfloat16"}, training={"mixed_precision": "bf16"}),
        ),
        world_size=1,
    )
    size = checkpoint_size(shape, _knobs(bf16, 1))
    assert (size.model_bytes, size.train_state_bytes) == (2 * n, 4 * n + 2 * 4 * n)


def test_disk_fails_without_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stagectl.models.loading import resolve_model_path

    resolve_model_path("builtin:tiny-qwen2.5-vl")
    shape = model_shape("builtin:tiny-qwen2.5-vl")
    cfg = load_config(
        _write(
            tmp_path, _config(tmp_path, training={"max_steps": 8, "save_steps": 2, "save_total_limit": 2})
        ),
        world_size=1,
    )
    line = check_disk(cfg.training, shape, _knobs(cfg, 1))
    assert line.status == "ok" and line.message.startswith("3 checkpoint(s) of ")
    # a full disk: the filesystem of output_dir reports 1 MiB free
    real = resource_checks.free_bytes
    monkeypatch.setattr(resource_checks, "free_bytes", lambda path: (real(path)[0], 2**20))
    line = check_disk(cfg.training, shape, _knobs(cfg, 1))
    assert line.status == "fail" and "1.0 MiB free at" in line.message
    assert "training.save_total_limit (now 2) lower" in line.fix
    assert not (tmp_path / "run").exists()  # the check creates no run directory


def test_train_ab_preflight_warns_when_the_kept_checkpoints_will_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stagectl.doctor.resource_checks import disk_warning

    cfg = load_config(
        _write(
            tmp_path, _config(tmp_path, training={"max_steps": 8, "save_steps": 2, "save_total_limit": 2})
        ),
        world_size=1,
    )
    assert disk_warning(cfg.model, cfg.training, _knobs(cfg, 1)) is None
    real = resource_checks.free_bytes
    monkeypatch.setattr(resource_checks, "free_bytes", lambda path: (real(path)[0], 2**20))
    warning = disk_warning(cfg.model, cfg.training, _knobs(cfg, 1))
    assert warning is not None and "3 checkpoint(s) of " in warning and "1.0 MiB free at" in warning
    assert "save_total_limit (now 2) lower" in warning
    one = cfg.training.model_copy(update={"save_total_limit": 1})
    line = resource_checks.check_disk(one, model_shape(cfg.model.name_or_path), _knobs(cfg, 1))
    assert line.status == "fail" and "lower" not in line.fix  # at 1 there is no lower limit to suggest
    assert line.fix.endswith(
        "(training.save_total_limit is 1: the newest checkpoint is kept until the next one is whole)"
    )


def test_gpu_estimate_against_the_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from stagectl.models.loading import resolve_model_path

    resolve_model_path("builtin:tiny-qwen2.5-vl")
    shape = model_shape("builtin:tiny-qwen2.5-vl")
    cfg = load_config(
        _write(
            tmp_path,
            _config(tmp_path, launch={"nproc_per_node": 2}, stage2_ab={"schedule": {"b_ratio": 0.0}}),
        ),
        world_size=2,
    )
    if not torch.cuda.is_available():
        (line,) = check_gpu(cfg.launch.nproc_per_node, shape, _knobs(cfg, 2))
        assert line.status == "skip" and "no CUDA" in line.message
    # a node with one small card (the test stands in for CUDA)
    card = SimpleNamespace(total_memory=2**20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tiny GPU")
    lines = check_gpu(cfg.launch.nproc_per_node, shape, _knobs(cfg, 2))
    assert [(c.name, c.status) for c in lines] == [("resources.gpus", "fail"), ("resources.gpu", "fail")]
    assert "nproc_per_node is 2 but this node has 1 visible" in lines[0].message
    assert "of 0.0 GiB on Tiny GPU" in lines[1].message and "fsdp" in lines[1].fix
    card.total_memory = 2**40
    single = load_config(_write(tmp_path, _config(tmp_path)), world_size=1)
    (line,) = check_gpu(single.launch.nproc_per_node, shape, _knobs(single, 1))
    assert line.status == "ok" and "of 1024.0 GiB on Tiny GPU" in line.message


def test_cli_nproc_sets_the_world_size_as_train_ab_does(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stagectl.cli.app import app

    path = _write(tmp_path, _config(tmp_path))
    result = CliRunner().invoke(app, ["doctor", str(path), "--nproc", "2", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert [c["status"] for c in report["checks"]] == ["fail"]  # nothing else runs on an invalid config
    assert report["checks"][0]["message"].startswith("stage2_ab.channel_b.mode: 'step' runs Channel-B")
    assert "the world size is 2" in report["checks"][0]["message"]


# ---------------------------------------------------------------- run directory


def test_run_dir_gives_train_ab_s_verdict_and_way_forward(tmp_path: Path) -> None:
    """Doctor's `training.output_dir` line is train-ab's own verdict (`rundir.policy.train_dir_verdict`): a
    directory holding a run fails without --resume / --overwrite, with train-ab's message, and doctor
    changes nothing there."""
    from stagectl.doctor.run_dir_check import check_run_dir
    from stagectl.rundir.policy import prepare_train_dir

    out = tmp_path / "run"
    cfg = load_config(_write(tmp_path, _config(tmp_path)), world_size=1)
    line = check_run_dir(cfg.training, resume=False)
    assert line.status == "ok" and line.message == f"{out} holds no run: train-ab starts a new one there"

    (out / "checkpoint-12").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    line = check_run_dir(cfg.training, resume=False)
    with pytest.raises(ValueError) as refused:
        prepare_train_dir(out, None, False)
    assert line.status == "fail" and line.name == "training.output_dir"
    assert line.message == f"train-ab will refuse to start: {refused.value}"
    assert "already holds a run (1 metrics row, checkpoint-12)" in line.message
    assert line.fix.startswith(
        "train-ab (and doctor) --resume continues that run, --overwrite moves it aside"
    )
    # --resume: train-ab wants a complete checkpoint to continue from
    line = check_run_dir(cfg.training, resume=True)
    assert line.status == "fail" and "no complete checkpoint to continue from" in line.message
    assert "--resume" not in line.fix
    (out / "checkpoint-12" / "trainer_state.json").write_text("{}")
    line = check_run_dir(cfg.training, resume=True)
    assert line.status == "ok" and "train-ab --resume continues it from latest" in line.message
    overwrite = cfg.training.model_copy(update={"overwrite_output_dir": True})
    line = check_run_dir(overwrite, resume=False)
    assert (
        line.status == "ok" and "train-ab --overwrite moves it aside to run.replaced-<time>" in line.message
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "run"]  # nothing moved or written
