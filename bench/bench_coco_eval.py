"""COCO bbox evaluators: pycocotools (the reference) versus faster-coco-eval on the same synthetic
ground truth and predictions (500 images, 10 categories, ~6 GT and 20 scored detections per image):
wall time of load + evaluate + accumulate + summarize, and whether the 12 summary numbers agree.

Run: `python -m bench.bench_coco_eval`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import contextlib
import copy
import io
import statistics
import time
from typing import Any

import numpy as np

NUM_IMAGES = 500
NUM_CATEGORIES = 10
DETS_PER_IMAGE = 20


def synthetic(seed: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(COCO ground-truth dict, COCO results list): detections are jittered GT boxes plus spurious ones."""
    rng = np.random.default_rng(seed)
    images, annotations, results = [], [], []
    for image_id in range(1, NUM_IMAGES + 1):
        width, height = 640, 480
        images.append({"id": image_id, "width": width, "height": height, "file_name": f"{image_id}.jpg"})
        gts = []
        for _ in range(int(rng.integers(1, 12))):
            w, h = rng.uniform(8, 300), rng.uniform(8, 300)
            x, y = rng.uniform(0, width - w), rng.uniform(0, height - h)
            category = int(rng.integers(1, NUM_CATEGORIES + 1))
            ann = {
                "id": len(annotations) + 1,
                "image_id": image_id,
                "category_id": category,
                "bbox": [x, y, w, h],
                "area": w * h,
                "iscrowd": 0,
            }
            annotations.append(ann)
            gts.append(ann)
        for k in range(DETS_PER_IMAGE):
            if k < len(gts) and rng.random() < 0.8:
                x, y, w, h = gts[k]["bbox"]
                box = [
                    x + rng.normal(0, 6),
                    y + rng.normal(0, 6),
                    w * rng.uniform(0.8, 1.2),
                    h * rng.uniform(0.8, 1.2),
                ]
                category = (
                    gts[k]["category_id"] if rng.random() < 0.9 else int(rng.integers(1, NUM_CATEGORIES + 1))
                )
            else:
                w, h = rng.uniform(8, 200), rng.uniform(8, 200)
                box = [rng.uniform(0, width - w), rng.uniform(0, height - h), w, h]
                category = int(rng.integers(1, NUM_CATEGORIES + 1))
            results.append(
                {
                    "image_id": image_id,
                    "category_id": category,
                    "bbox": box,
                    "score": float(rng.uniform(0.05, 1)),
                }
            )
    categories = [{"id": c, "name": f"class{c}"} for c in range(1, NUM_CATEGORIES + 1)]
    return {"images": images, "annotations": annotations, "categories": categories}, results


def pycocotools_stats(gt: dict[str, Any], results: list[dict[str, Any]]) -> list[float]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = copy.deepcopy(gt)
        coco.createIndex()
        evaluator = COCOeval(coco, coco.loadRes(copy.deepcopy(results)), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return [float(v) for v in evaluator.stats]


def faster_stats(gt: dict[str, Any], results: list[dict[str, Any]]) -> list[float]:
    from faster_coco_eval import COCO, COCOeval_faster

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(copy.deepcopy(gt))
        evaluator = COCOeval_faster(coco, coco.loadRes(copy.deepcopy(results)), "bbox", print_function=print)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return [float(v) for v in evaluator.stats[:12]]


def run(repeats: int = 5) -> dict[str, Any]:
    gt, results = synthetic()
    times: dict[str, list[float]] = {"pycocotools": [], "faster_coco_eval": []}
    stats: dict[str, list[float]] = {}
    for _ in range(repeats):  # interleaved, so load on the shared machine hits both alike
        for name, fn in (("pycocotools", pycocotools_stats), ("faster_coco_eval", faster_stats)):
            started = time.perf_counter()
            stats[name] = fn(gt, results)
            times[name].append(time.perf_counter() - started)
    diff = max(abs(a - b) for a, b in zip(stats["pycocotools"], stats["faster_coco_eval"], strict=True))
    return {
        "num_images": NUM_IMAGES,
        "num_gt": len(gt["annotations"]),
        "num_detections": len(results),
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "min_s": {name: min(t) for name, t in times.items()},
        "speedup_median": statistics.median(times["pycocotools"])
        / statistics.median(times["faster_coco_eval"]),
        "stats": stats,
        "max_abs_diff": diff,
    }


def main() -> None:
    r = run()
    print(f"{r['num_images']} images, {r['num_gt']} GT, {r['num_detections']} detections")
    for name in ("pycocotools", "faster_coco_eval"):
        print(f"{name:>17}: median {r['median_s'][name]:.3f} s  min {r['min_s'][name]:.3f} s")
    print(f"speedup {r['speedup_median']:.2f}x; max |stats difference| {r['max_abs_diff']:.2e}")
    print("AP/AP50/AP75:", [round(v, 4) for v in r["stats"]["pycocotools"][:3]])


if __name__ == "__main__":
    main()
