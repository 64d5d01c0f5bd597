"""95% intervals of held-out detection metrics by a two-level (seeds, then images) bootstrap. Pure numpy.

Input: for one variant (e.g. "AB clean_prefix"), one array per seed of the per-image counters the
evaluator writes (`eval.jsonl` rows, `per_image` with `per_image_fields`), all seeds evaluated on the SAME
held-out images. A resample draws the seeds with replacement, then the image indices with replacement
(one draw of images shared by every seed and every variant compared, so comparisons are paired on
images), and computes each metric per seed from the summed counts (micro precision/recall/F1, as the
evaluator does) and averages over the seeds. The 2.5/97.5 percentiles of 2000 resamples are the
interval. With one seed this is the plain image bootstrap; with several it also carries the
seed-to-seed spread (with 3 seeds that part is coarse: the seed table shows each seed as well).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

FIELDS = ("n_gt", "n_valid", "n_matched", "n_invalid", "n_truncated", "n_dup", "n_matched_desc")
# f1 is box-only (class-agnostic); f1_desc counts a match only with the right desc; desc_accuracy is the
# share of box matches whose desc is right (docs/evaluation.md)
METRICS = ("f1", "precision", "recall", "invalid_rate", "dup_rate", "f1_desc", "desc_accuracy")
NUM_RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    value: float  # the metric on the data as observed (mean over seeds)
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def counts_from_row(row: Mapping[str, object]) -> np.ndarray:
    """[num_images, len(FIELDS)] from one eval row (ValueError when it has no per-image counters)."""
    names = row.get("per_image_fields")
    values = row.get("per_image")
    if not isinstance(names, list) or not isinstance(values, list):
        raise ValueError(
            "eval row has no per_image counters (written by stagectl >= the clean-prefix release)"
        )
    table = np.asarray(values, dtype=np.float64).reshape(len(values), len(names))
    # rows written before the desc-aware counter have no n_matched_desc: its metrics come out NaN
    missing = np.full((len(values), 1), np.nan)
    return np.concatenate([table[:, [names.index(f)]] if f in names else missing for f in FIELDS], axis=1)


def _metrics(sums: np.ndarray, num_images: int) -> dict[str, np.ndarray]:
    """Metrics from summed counts [..., len(FIELDS)] (leading axes kept)."""
    gt, valid, matched, invalid, truncated, dup, matched_desc = (sums[..., k] for k in range(len(FIELDS)))
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(valid > 0, matched / np.maximum(valid, 1), 0.0)
        recall = np.where(gt > 0, matched / np.maximum(gt, 1), 0.0)
        total = precision + recall
        f1 = np.where(total > 0, 2 * precision * recall / np.where(total > 0, total, 1), 0.0)
        # desc-aware: a match counts only with the right desc (NaN propagates for rows without the counter)
        denominator = valid + gt
        f1_desc = np.where(denominator > 0, 2 * matched_desc / np.where(denominator > 0, denominator, 1), 0.0)
        desc_accuracy = np.where(matched > 0, matched_desc / np.maximum(matched, 1), 0.0)
        return {
            "f1": f1,
            "precision": precision,
            "recall": recall,
            "invalid_rate": (invalid + truncated) / max(1, num_images),
            "dup_rate": np.where(valid > 0, dup / np.maximum(valid, 1), 0.0),
            "f1_desc": np.where(np.isnan(matched_desc), np.nan, f1_desc),
            "desc_accuracy": np.where(np.isnan(matched_desc), np.nan, desc_accuracy),
        }


def _check(per_seed: Sequence[np.ndarray]) -> np.ndarray:
    if not per_seed:
        raise ValueError("no runs to summarise")
    shapes = {a.shape for a in per_seed}
    if len(shapes) != 1:
        raise ValueError(f"runs were evaluated on different numbers of images: {sorted(shapes)}")
    return np.stack(per_seed)  # [S, N, F]


def _draws(num_seeds: int, num_images: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    seeds = rng.integers(0, num_seeds, size=(NUM_RESAMPLES, num_seeds))  # [B, S]
    images = rng.integers(0, num_images, size=(NUM_RESAMPLES, num_images))  # [B, N]
    return seeds, images


def _resampled(counts: np.ndarray, seeds: np.ndarray, images: np.ndarray) -> dict[str, np.ndarray]:
    """Per-resample metric (mean over the drawn seeds) -> [B] each."""
    per_image_sums = np.stack([counts[:, idx].sum(axis=1) for idx in images])  # [B, S, F]
    drawn = np.take_along_axis(per_image_sums, seeds[:, :, None], axis=1)  # [B, S, F]
    return {k: v.mean(axis=1) for k, v in _metrics(drawn, counts.shape[1]).items()}


def _observed(counts: np.ndarray) -> dict[str, float]:
    return {k: float(v.mean()) for k, v in _metrics(counts.sum(axis=1), counts.shape[1]).items()}


def variant_intervals(per_seed: Sequence[np.ndarray], seed: int = 0) -> dict[str, Interval]:
    """Each metric's mean over seeds with its 95% interval (see the module docstring)."""
    counts = _check(per_seed)
    draws = _draws(counts.shape[0], counts.shape[1], np.random.default_rng(seed))
    boot = _resampled(counts, *draws)
    observed = _observed(counts)
    return {
        k: Interval(observed[k], float(np.percentile(boot[k], 2.5)), float(np.percentile(boot[k], 97.5)))
        for k in METRICS
    }


def difference_intervals(
    per_seed: Sequence[np.ndarray], baseline: Sequence[np.ndarray], seed: int = 0
) -> dict[str, Interval]:
    """`variant - baseline` for each metric with its 95% interval: the same image draw for both (paired on
    images), seeds drawn independently per variant (the runs share no seed-level randomness)."""
    a, b = _check(per_seed), _check(baseline)
    if a.shape[1] != b.shape[1]:
        raise ValueError("the variants were evaluated on different numbers of images")
    rng = np.random.default_rng(seed)
    seeds_a, images = _draws(a.shape[0], a.shape[1], rng)
    seeds_b = rng.integers(0, b.shape[0], size=(NUM_RESAMPLES, b.shape[0]))
    boot_a, boot_b = _resampled(a, seeds_a, images), _resampled(b, seeds_b, images)
    obs_a, obs_b = _observed(a), _observed(b)
    out = {}
    for k in METRICS:
        diff = boot_a[k] - boot_b[k]
        out[k] = Interval(
            obs_a[k] - obs_b[k], float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))
        )
    return out
