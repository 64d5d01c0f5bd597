"""Packing efficiency, two questions.

1. A fixed set of segments into the fewest packs (step-mode Channel-B): ours (best-fit decreasing) vs
   next-fit in arrival order vs the `binpacking` library's constant-volume packer (what ms-swift uses),
   on lognormal, uniform, bimodal and near-half length mixes: packs / lower bound, fill and time.
2. What one learner micro-batch holds (Channel-A): the old learner's micro-batch of
   `per_device_train_batch_size` samples (packed together, so bs 1 is one sample per forward) vs today's
   one sequence filled from a look-ahead buffer (`packing.PackBuffer`): fill and tokens per forward, on
   the tiny synthetic data set's real segment lengths at 1024 / 2048 tokens and on a VLM-sized mix at
   the upstream's 12000.

Run: `python -m bench.bench_packing`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.common import interleaved_times_s, summary
from stagectl.packing import PackBuffer, pack_segments, packing_lower_bound

ROOT = Path(__file__).parents[1]

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
    return {"bin_packing": run_bin_packing(sizes, repeats, seed), "micro_batches": run_micro_batches()}


def run_bin_packing(sizes: Sequence[int], repeats: int, seed: int) -> dict[str, dict[str, object]]:
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


def micro_batch_fill(
    lengths: Sequence[int],
    packing_length: int,
    *,
    per_sample: int = 0,
    buffer_size: int = 0,
    forwards: int = 400,
) -> dict[str, float]:
    """Fill and tokens per forward of `forwards` micro-batches drawn from `lengths` in order (cycled):
    `per_sample` samples each (the old way), or one pack from a look-ahead buffer of `buffer_size`."""
    stream = (lengths[k % len(lengths)] for k in range(10**9))
    tokens: list[int] = []
    if per_sample:
        for _ in range(forwards):
            group = [next(stream) for _ in range(per_sample)]
            # the old learner packed the micro-batch's samples: more than one sequence when they overflow
            packs = pack_segments(group, packing_length)
            tokens += [sum(group[i] for i in p) for p in packs]
    else:
        buffer: PackBuffer[int] = PackBuffer(packing_length)
        for _ in range(forwards):
            while len(buffer) < buffer_size:
                buffer.add(0, next(stream))
            tokens.append(sum(length for _, length in buffer.pop_pack()))
    fills = [t / packing_length for t in tokens]
    return {
        "fill": float(np.mean(fills)),
        "fill_min": float(np.min(fills)),
        "tokens_per_forward": float(np.mean(tokens)),
    }


def tiny_channel_a_lengths(num_samples: int = 256) -> list[int]:
    """Channel-A segment lengths of the tiny Qwen2.5-VL on `examples/tiny/train_ab.yaml`'s data."""
    from stagectl.config import load_config
    from stagectl.detection.vocab import TokenVocab
    from stagectl.learner.segments import SampleEncoder
    from stagectl.learner.setup import load_train_samples
    from stagectl.models.loading import load_bundle

    cfg = load_config(ROOT / "examples/tiny/train_ab.yaml", [f"data.synthetic.num_samples={num_samples}"])
    bundle = load_bundle(cfg.model.name_or_path, torch_dtype="float32", device="cpu")
    assert cfg.data is not None
    samples = load_train_samples(cfg.data)
    encoder = SampleEncoder(bundle=bundle, samples=samples, vocab=TokenVocab.from_tokenizer(bundle.tokenizer))
    order = np.random.default_rng(0).permutation(len(samples))
    return [encoder.channel_a_length(int(i)) for i in order]


def run_micro_batches() -> dict[str, dict[str, object]]:
    rng = np.random.default_rng(1)
    vlm = [int(x) for x in np.clip(rng.lognormal(np.log(1500), 0.45, size=2048), 300, 11000)]
    tiny = tiny_channel_a_lengths()
    out: dict[str, dict[str, object]] = {}
    for name, lengths, cap in (
        ("tiny synthetic", tiny, 1024),
        ("tiny synthetic", tiny, 2048),
        ("VLM mix", vlm, 12000),
    ):
        row: dict[str, object] = {"data": name, "packing_length": cap, "mean_length": float(np.mean(lengths))}
        for label, kwargs in (
            ("per_sample_bs1", {"per_sample": 1}),
            ("per_sample_bs4", {"per_sample": 4}),
            ("buffer_64", {"buffer_size": 64}),
            ("buffer_256", {"buffer_size": 256}),
        ):
            row[label] = micro_batch_fill(lengths, cap, **kwargs)  # type: ignore[arg-type]
        out[f"{name}/{cap}"] = row
    return out


def main() -> None:
    both = run()
    results = both["bin_packing"]
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

    print("micro-batch fill (mean / min) and tokens per forward")
    for row in both["micro_batches"].values():
        cells = [
            f"{k}: {v['fill']:.2f}/{v['fill_min']:.2f} {v['tokens_per_forward']:.0f}"  # type: ignore[index]
            for k, v in row.items()
            if isinstance(v, dict)
        ]
        print(f"{row['data']} L={row['packing_length']}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
