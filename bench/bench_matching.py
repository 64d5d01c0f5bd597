"""Hungarian matching cost: `hungarian_match` (IoU + augmented matrix + solve) versus a bare
`linear_sum_assignment` on the same precomputed augmented matrix, at 10, 50, 100 and 300 objects.

Run: `python -m bench.bench_matching`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import statistics
from functools import partial

import numpy as np
from scipy.optimize import linear_sum_assignment

from bench.common import interleaved_times_s
from stagectl.detection.matching import augmented_cost, hungarian_match, pairwise_iou

SIZES = (10, 50, 100, 300)


def _instance(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n GT boxes in bins and n predictions: most jittered copies of a GT box, some spurious."""
    corner = rng.uniform(0, 850, size=(n, 2))
    gt = np.concatenate([corner, corner + rng.uniform(10, 150, size=(n, 2))], axis=1)  # [n, 4]
    pred = gt[rng.permutation(n)] + rng.normal(0, 6, size=(n, 4))  # [n, 4]
    spurious = rng.random(n) < 0.2
    pred[spurious] = np.concatenate([corner[spurious][:, ::-1], corner[spurious][:, ::-1] + 40], axis=1)
    return np.clip(np.round(pred), 0, 999), np.clip(np.round(gt), 0, 999)


def _summary(times: list[float]) -> dict[str, float]:
    return {"min_ms": min(times), "median_ms": statistics.median(times), "max_ms": max(times)}


def run(repeats: int = 30, seed: int = 0) -> dict[str, dict[str, object]]:
    rng = np.random.default_rng(seed)
    results: dict[str, dict[str, object]] = {}
    for n in SIZES:
        pred, gt = _instance(rng, n)
        cost = augmented_cost(pairwise_iou(pred, gt), iou_gate=0.3, fp_cost=1.0, fn_cost=1.0)  # [2n, 2n]
        ours_s, raw_s = interleaved_times_s(
            [partial(hungarian_match, pred, gt), partial(linear_sum_assignment, cost)], repeats
        )
        ours_ms, raw_ms = [t * 1e3 for t in ours_s], [t * 1e3 for t in raw_s]
        ours, raw = _summary(ours_ms), _summary(raw_ms)
        results[f"n={n}"] = {
            "num_objects": n,
            "hungarian_match": ours,
            "raw_linear_sum_assignment": raw,
            "ratio_median": ours["median_ms"] / raw["median_ms"],
            "num_matched": len(hungarian_match(pred, gt).pairs),
        }
    return results


def _fmt(summary: object) -> str:
    assert isinstance(summary, dict)
    return f"{summary['min_ms']:.3f} / {summary['median_ms']:.3f} / {summary['max_ms']:.3f}"


def main() -> None:
    results = run()
    print("matching: hungarian_match vs raw linear_sum_assignment on the precomputed augmented matrix")
    print(
        f"{'objects':>7}  {'ours ms (min/med/max)':>28}  {'raw ms (min/med/max)':>28}  {'ratio':>6}  {'matched':>7}"
    )
    for row in results.values():
        ours, raw = _fmt(row["hungarian_match"]), _fmt(row["raw_linear_sum_assignment"])
        print(
            f"{row['num_objects']:>7}  {ours:>28}  {raw:>28}  {row['ratio_median']:>6.2f}  {row['num_matched']:>7}"
        )


if __name__ == "__main__":
    main()
