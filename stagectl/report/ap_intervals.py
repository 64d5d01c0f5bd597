"""95% intervals of COCO AP by the two-level bootstrap of `stagectl.report.intervals` (seeds, then
held-out images; one image draw shared by the variants compared, so differences are paired on images).

AP is computed by the maintained evaluator, not by us: pycocotools' `COCOeval.evaluate()` runs once per
run (every image's matches, at every IoU threshold, per category), then each resample runs the same
evaluator's `accumulate()` over the drawn images (an image drawn twice counts twice, as a bootstrap needs)
and AP is `summarize()`'s: the mean precision over IoU .50:.95 and the 101 recall points, over the
categories with ground truth, at 100 detections, all areas. On the images as observed it equals the
`AP` / `AP_agnostic` of the eval row (a test checks it against the written files).

Input per run: `eval_gt.coco.json` and one step's row of `eval_predictions.jsonl` (train-ab writes both).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stagectl.evaluation.coco import agnostic_results
from stagectl.report.intervals import NUM_RESAMPLES, Interval

PREDICTIONS_FILE = "eval_predictions.jsonl"
GT_FILE = "eval_gt.coco.json"
# the images of the evals before step N when a resume changed the held-out set (learner.evaluate)
GT_BEFORE = re.compile(r"eval_gt\.before-step-(\d+)\.coco\.json")


class RunAP:
    """One run's predictions at one eval step, evaluated once; `ap(positions)` re-accumulates a draw."""

    def __init__(self, gt: dict[str, Any], predictions: Sequence[dict[str, Any]], *, use_cats: bool = True):
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        self.notes: list[str] = []  # what reading the predictions skipped (`load_run_ap`)
        self.image_ids = [int(i["id"]) for i in gt["images"]]
        self.has_gt = any(not a.get("iscrowd", 0) for a in gt["annotations"])  # crowd: not objects
        self.empty = not predictions
        if self.empty or not self.has_gt:
            return
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its own progress
            coco_gt = COCO()
            coco_gt.dataset = copy.deepcopy(gt)
            coco_gt.createIndex()
            evaluator = COCOeval(coco_gt, coco_gt.loadRes(copy.deepcopy(list(predictions))), "bbox")
            evaluator.params.useCats = int(use_cats)
            evaluator.params.imgIds = list(self.image_ids)
            evaluator.params.areaRng = [[0.0, 1e10]]
            evaluator.params.areaRngLbl = ["all"]
            evaluator.params.maxDets = [100]
            evaluator.evaluate()
        self._evaluator = evaluator
        self._per_image = list(evaluator.evalImgs)  # [category][image], one area range
        self._num_cats = len(evaluator.params.catIds) if use_cats else 1

    def ap(self, positions: Sequence[int] | np.ndarray) -> float:
        """AP over the images at `positions` (indices into the GT's image list, repeats allowed)."""
        if not self.has_gt:
            return -1.0
        if self.empty:
            return 0.0
        evaluator, n = self._evaluator, len(self.image_ids)
        drawn = [int(p) for p in positions]
        ids = list(range(len(drawn)))  # every drawn image its own id, so a repeat counts twice
        evaluator.evalImgs = [self._per_image[k * n + p] for k in range(self._num_cats) for p in drawn]
        evaluator.params.imgIds = ids
        evaluator._paramsEval = copy.copy(evaluator.params)
        with contextlib.redirect_stdout(io.StringIO()):
            evaluator.accumulate()
        precision = evaluator.eval["precision"][:, :, :, 0, -1]  # (IoU, recall, category)
        valid = precision[precision > -1]
        return float(valid.mean()) if valid.size else -1.0


def load_run_ap(run_dir: Path, step: int, *, use_cats: bool = True) -> RunAP:
    """`RunAP` of a train-ab run's eval at `step` (ValueError naming the file when it is missing or not
    JSON). A torn last line of the predictions (a run that crashed while appending) is skipped and noted in
    the result's `notes`, as `stagectl report` does with the other JSONL files."""
    from stagectl.report.jsonl import read_jsonl

    gt_path, pred_path = ground_truth_of(run_dir, step), run_dir / PREDICTIONS_FILE
    for path in (gt_path, pred_path):
        if not path.is_file():
            raise ValueError(f"{path} is missing: AP intervals need train-ab's eval predictions")
    predictions = read_jsonl(pred_path)
    at = [r for r in predictions.rows if r.get("step") == step]
    if not at:
        steps = [r.get("step") for r in predictions.rows]
        raise ValueError(f"{pred_path} has no eval at step {step} (steps: {steps})")
    try:
        gt = json.loads(gt_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{gt_path}: not valid JSON ({exc})") from None
    predictions_at = at[-1]["predictions"]
    if not use_cats:  # the class-agnostic AP scores the predictions whose desc is no category too
        predictions_at = agnostic_results(gt, predictions_at, at[-1].get("unknown_category", []))
    run = RunAP(gt, predictions_at, use_cats=use_cats)
    run.notes = predictions.notes()
    return run


def ground_truth_of(run_dir: Path, step: int) -> Path:
    """The ground truth the eval at `step` scored: `eval_gt.coco.json`, or for an eval before a resume that
    changed the held-out set, the `eval_gt.before-step-N.coco.json` of the first such N above `step`."""
    changes = sorted(
        (int(match.group(1)), path)
        for path in run_dir.glob("eval_gt.before-step-*.coco.json")
        if (match := GT_BEFORE.fullmatch(path.name))
    )
    return next((path for first_new, path in changes if step < first_new), run_dir / GT_FILE)


def image_draws(num_images: int, resamples: int, seed: int = 0) -> np.ndarray:
    """[resamples, num_images] image positions drawn with replacement (share one across the variants
    compared, so their differences are paired on images)."""
    return np.random.default_rng(seed).integers(0, num_images, size=(resamples, num_images))


def resampled_ap(run: RunAP, draws: np.ndarray) -> np.ndarray:
    """[resamples]: the run's AP on each draw of images."""
    return np.asarray([run.ap(images) for images in draws])


def seed_means(per_seed: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """[resamples]: per resample, the mean over seeds drawn with replacement of their resampled values."""
    stacked = np.stack(per_seed)  # [S, B]
    picks = rng.integers(0, stacked.shape[0], size=(stacked.shape[1], stacked.shape[0]))  # [B, S]
    return stacked[picks, np.arange(stacked.shape[1])[:, None]].mean(axis=1)


def interval(observed: float, samples: np.ndarray) -> Interval:
    return Interval(observed, float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5)))


@dataclass(frozen=True)
class APIntervals:
    value: Interval  # the variant's AP, mean over seeds
    delta: Interval | None  # variant - baseline, paired on images (None without a baseline)


def ap_intervals(
    runs: Sequence[RunAP],
    baseline: Sequence[RunAP] | None = None,
    *,
    resamples: int = NUM_RESAMPLES // 4,
    seed: int = 0,
) -> APIntervals:
    """The AP of `runs` (the seeds of one variant) with its interval, and its difference to `baseline`'s."""
    if not runs:
        raise ValueError("no runs to summarise")
    sizes = {len(r.image_ids) for r in [*runs, *(baseline or [])]}
    if len(sizes) != 1:
        raise ValueError(f"runs were evaluated on different numbers of images: {sorted(sizes)}")
    n = sizes.pop()
    draws = image_draws(n, resamples, seed)
    rng = np.random.default_rng(seed + 1)
    everything = np.arange(n)
    observed = float(np.mean([r.ap(everything) for r in runs]))
    boot = seed_means([resampled_ap(r, draws) for r in runs], rng)
    if not baseline:
        return APIntervals(interval(observed, boot), None)
    observed_base = float(np.mean([r.ap(everything) for r in baseline]))
    boot_base = seed_means([resampled_ap(r, draws) for r in baseline], rng)
    return APIntervals(interval(observed, boot), interval(observed - observed_base, boot - boot_base))
