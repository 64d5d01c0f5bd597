"""COCO -> JSONL -> train-ab, the README quick start, end to end: `stagectl convert coco` on a small COCO-format
file the test writes, then `stagectl train-ab examples/coco/train_ab.yaml` for two steps (one A, one B) with
the converted file as training and eval data. Everything else about the converter is in
tests/unit/data/test_coco.py (in process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.integration.helpers import read_metrics, run_cli

W, H = 112, 84
# (image file stem, [(category id, [x, y, w, h], iscrowd), ...]); category ids are COCO-like: not contiguous
IMAGES: list[tuple[str, list[tuple[int, list[float], int]]]] = [
    ("000000000139", [(1, [10.5, 8.25, 30.0, 40.5], 0), (18, [60.0, 20.0, 40.0, 30.0], 0)]),
    ("000000000285", [(44, [5.0, 5.0, 20.0, 20.0], 0), (1, [0.0, 0.0, 112.0, 84.0], 1)]),  # + a crowd box
    ("000000000632", [(18, [90.0, 60.0, 40.0, 40.0], 0)]),  # runs past the right and bottom edges: clamped
    ("000000000724", []),  # no annotation: kept as an empty sample
    (
        "000000000776",
        [(44, [30.0, 30.0, 0.0, 10.0], 0), (1, [40.0, 10.0, 50.0, 60.0], 0)],
    ),  # + a zero-area box
]
CATEGORIES = [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}, {"id": 44, "name": "bottle"}]
NUM_KEPT = 5  # objects left after the crowd and the zero-area box


def write_coco(root: Path) -> Path:
    """Images (PNG rectangles where the boxes are) and `instances.json` under `root`."""
    from PIL import Image, ImageDraw

    (root / "images").mkdir()
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for image_id, (stem, anns) in enumerate(IMAGES, start=100):
        image = Image.new("RGB", (W, H), "white")
        draw = ImageDraw.Draw(image)
        for cat_id, (x, y, w, h), crowd in anns:
            if w > 0 and not crowd:
                draw.rectangle(
                    [x, y, min(x + w, W - 1), min(y + h, H - 1)], fill=("red", "green", "blue")[cat_id % 3]
                )
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": cat_id,
                    "bbox": [x, y, w, h],
                }
                | {"iscrowd": crowd, "area": w * h}
            )
        image.save(root / "images" / f"{stem}.png")
        images.append({"id": image_id, "file_name": f"{stem}.png", "width": W, "height": H})
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": CATEGORIES}))
    return path


def test_coco_converts_and_trains_with_the_example_config(tmp_path: Path) -> None:
    instances = write_coco(tmp_path)
    out = tmp_path / "data" / "coco.jsonl"
    converted = run_cli(
        "convert", "coco", str(instances), "--images", str(tmp_path / "images"), "--out", str(out)
    )
    assert converted.returncode == 0, converted.stderr
    summary = converted.stdout.strip()
    assert summary.startswith(
        f"wrote 5 images (1 without objects), {NUM_KEPT} objects of 3 categories to {out}"
    )
    assert (
        "crowd regions (iscrowd: 1, eval only, not trained on): 1; skipped: 1 zero-area, 0 zero-area on the "
        "norm-1000 grid, 0 outside the image; clamped to the image: 1" in summary
    )
    assert "data.box_format: pixel" in summary

    run_dir = tmp_path / "run"
    sets = {
        "data.train_jsonl": out,
        "data.eval.jsonl": out,
        "training.output_dir": run_dir,
        "training.max_steps": 2,
        "training.gradient_accumulation_steps": 1,
        "training.warmup_steps": 0,
        "training.learning_rate": 1e-3,
        "global_max_length": 512,
        "stage2_ab.schedule.b_ratio": 0.5,
        "stage2_ab.channel_b.rollouts_per_step": 2,
        "custom.extra.rollout_matching.max_new_tokens": 24,
    }
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    result = run_cli("train-ab", "examples/coco/train_ab.yaml", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["kind"] for row in read_metrics(run_dir)] == ["A", "B"]
    (row,) = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert row["step"] == 2 and row["n_samples"] == 5 and row["n_gt"] == NUM_KEPT

    # ... and `stagectl eval` scores the checkpoint in COCO's own ids
    eval_dir = tmp_path / "eval"
    sets_eval = {k: v for k, v in sets.items() if k.startswith(("data.", "custom.", "global_max"))}
    eval_args = [arg for key, value in sets_eval.items() for arg in ("--set", f"{key}={value}")]
    evaluated = run_cli(
        "eval",
        "examples/coco/train_ab.yaml",
        "--model",
        str(run_dir / "checkpoint-2" / "model"),
        "--data",
        str(out),
        "--out",
        str(eval_dir),
        *eval_args,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    assert {"AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "f1"} <= set(metrics)
    predictions = json.loads((eval_dir / "predictions.coco.json").read_text())
    known_images = set(range(100, 100 + len(IMAGES)))
    assert all(p["image_id"] in known_images and p["category_id"] in {1, 18, 44} for p in predictions)
