"""Learner throughput on the tiny Qwen2.5-VL: packed micro-batches vs right-padded batches of the same
mixed-length Channel-A segments (forward + backward, real tokens per second).

Run: `python -m bench.bench_learner`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bench.common import interleaved_times_s, summary
from stagectl.collate import PackedBatch, Segment, collate_pack, collate_padded
from stagectl.config.plan_train import LossWeights
from stagectl.data.synthetic import generate_synthetic
from stagectl.detection.vocab import TokenVocab
from stagectl.learner.packs import PackRunner, StepAccumulator
from stagectl.learner.segments import SampleEncoder
from stagectl.models.loading import load_bundle
from stagectl.packing import pack_segments


def _train_pass(runner: PackRunner, batches: Sequence[PackedBatch]) -> None:
    """The learner's own forward/backward (`PackRunner.run_batch`) over every batch."""
    acc = StepAccumulator()
    for batch in batches:
        runner.run_batch(batch, scale=1.0, sync=True, acc=acc)
    runner.base_model.zero_grad(set_to_none=True)


def run(
    num_segments: int = 32, packing_length: int = 2048, padded_batch_size: int = 4, repeats: int = 3
) -> dict[str, object]:
    torch.manual_seed(0)
    bundle = load_bundle("builtin:tiny-qwen2.5-vl")
    model = bundle.model.train()
    samples = generate_synthetic(num_segments, seed=7, image_size=112, max_objects=8)
    encoder = SampleEncoder(bundle=bundle, samples=samples, vocab=TokenVocab.from_tokenizer(bundle.tokenizer))
    segments: list[Segment] = [encoder.channel_a_segment(i) for i in range(num_segments)]
    lengths = [len(s) for s in segments]
    packed = [
        collate_pack([segments[i] for i in group], model) for group in pack_segments(lengths, packing_length)
    ]
    pad_id = int(bundle.tokenizer.pad_token_id or 0)
    padded = [
        collate_padded(segments[i : i + padded_batch_size], pad_id)
        for i in range(0, num_segments, padded_batch_size)
    ]
    runner = PackRunner(
        ddp_model=model,
        base_model=model,
        loss_weights=LossWeights(),
        coord_token_ids=torch.tensor(bundle.coord_token_ids),
        packing_length=packing_length,
        device=torch.device("cpu"),
    )
    t_packed, t_padded = interleaved_times_s(
        [lambda: _train_pass(runner, packed), lambda: _train_pass(runner, padded)], repeats
    )
    real_tokens = sum(lengths)
    padded_tokens = sum(b.input_ids.numel() for b in padded)
    packed_tps = [real_tokens / t for t in t_packed]
    padded_tps = [real_tokens / t for t in t_padded]
    return {
        "num_segments": num_segments,
        "segment_lengths": {"min": min(lengths), "max": max(lengths), "mean": real_tokens / num_segments},
        "packing_length": packing_length,
        "num_packs": len(packed),
        "padded_batch_size": padded_batch_size,
        "padded_pad_fraction": 1 - real_tokens / padded_tokens,
        "packed_tokens_per_s": summary(packed_tps),
        "padded_tokens_per_s": summary(padded_tps),
        "ratio_median": summary(packed_tps)["median"] / summary(padded_tps)["median"],
    }


def main() -> None:
    r = run()
    print("learner: packed vs padded, forward+backward, real tokens/s (min/median/max)")
    for key, value in r.items():
        print(f"  {key}: {value}")


if __name__ == "__main__":
    main()
