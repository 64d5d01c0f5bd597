"""Packing efficiency: ours (best-fit decreasing) vs next-fit in arrival order vs the `binpacking`
library's constant-volume packer (what ms-swift uses), on lognormal, uniform, bimodal and near-half
length mixes. Reports packs / lower bound, fill and time.

Run: `python -m bench.bench_packing`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from bench.common import interleaved_times_s, summary
from stagectl.packing import pack_segments, packing_lower_bound

PACKING_LENGTH = 4096


def lengths_for(mix: str, n: int, rng: np.random.Generator, cap: int = PACKING_LENGTH) -> list[int]:
    if mix == "lognormal":
        raw = rng.lognormal(mean=6.0, sigma=0.8, size=n)
    elif mix == "uniform":
        raw = rng.uniform(16, cap, size=n)
    elif mix == "bimodal":
        short = rng.normal(300, 80, size=n)
        long = rng.normal(2600, 400, size=n)
        raw = np.where(rng.random(n) < 0.6, short, long)
    elif mix == "near_half":
        raw = rng.uniform(0.45 * cap, 0.55 * cap, size=n)
    else:
        raise ValueError(f"unknown mix {mix!r}")
    return [int(x) for x in np.clip(np.round(raw), 1, cap)]


def next_fit(lengths: Sequence[int], cap: int) -> list[list[int]]:
    packs: list[list[int]] = [[]]
    room = cap
    for i, length in enumerate(lengths):
        if length > room:
            packs.append([])
            room = cap
        packs[-1].append(i)
        room -= length
    return [p for p in packs if p]


def binpacking_constant_volume(lengths: Sequence[int], cap: int) -> list[list[int]]:
    import binpacking

    bins = binpacking.to_constant_volume(dict(enumerate(lengths)), cap)
    return [list(b) for b in bins]


PACKERS: dict[str, Callable[[Sequence[int], int], list[list[int]]]] = {
    "ours_bfd": pack_segments,
    "next_fit": next_fit,
    "binpacking_cv": binpacking_constant_volume,
}


def run(sizes: Sequence[int] = (512, 2048), repeats: int = 5, seed: int = 0) -> dict[str, dict[str, object]]:
    rng = np.random.default_rng(seed)
    results: dict[str, dict[str, object]] = {}
    for mix in ("lognormal", "uniform", "bimodal", "near_half"):
        for n in sizes:
            lengths = lengths_for(mix, n, rng)
            bound = packing_lower_bound(lengths, PACKING_LENGTH)
            packers = list(PACKERS.items())
            times = interleaved_times_s(
                [lambda p=p, ls=lengths: p(ls, PACKING_LENGTH) for _, p in packers], repeats
            )
            row: dict[str, object] = {"mix": mix, "num_items": n, "lower_bound": bound}
            for (name, packer), t in zip(packers, times, strict=True):
                packs = packer(lengths, PACKING_LENGTH)
                assert sorted(i for p in packs for i in p) == list(range(n))
                assert all(sum(lengths[i] for i in p) <= PACKING_LENGTH for p in packs)
                row[name] = {
                    "packs": len(packs),
                    "packs_over_bound": len(packs) / bound,
                    "fill": sum(lengths) / (len(packs) * PACKING_LENGTH),
                    "time_ms": {k: v * 1e3 for k, v in summary(t).items()},
                }
            results[f"{mix}/{n}"] = row
    return results


def main() -> None:
    results = run()
    print(f"packing (L={PACKING_LENGTH}): packs / lower bound, fill, median ms")
    print(f"{'mix':>10} {'n':>5} {'bound':>6}  " + "  ".join(f"{name:>26}" for name in PACKERS))
    for row in results.values():
        cells = []
        for name in PACKERS:
            r = row[name]
            assert isinstance(r, dict)
            cells.append(f"{r['packs_over_bound']:.3f} {r['fill']:.3f} {r['time_ms']['median']:8.2f}ms")
        print(
            f"{row['mix']:>10} {row['num_items']:>5} {row['lower_bound']:>6}  "
            + "  ".join(f"{c:>26}" for c in cells)
        )


if __name__ == "__main__":
    main()
