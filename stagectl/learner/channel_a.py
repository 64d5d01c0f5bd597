"""Channel-A: teacher forcing on ground-truth answers, one micro-batch per micro-step.

`training.packing: true` (the upstream's way): a micro-batch is ONE packed sequence of at most
`packing_length` tokens, chosen from this rank's look-ahead buffer of A-stream samples
(`training.packing_buffer` of them): the oldest buffered sample, then the largest others that still fit
(`packing.select_pack`). The buffer is topped up from the A stream before every pack, so the packs are a
pure function of the stream (seed, rank, world size); the buffer's sample indices are saved with each
checkpoint, so a resumed run packs exactly what the uninterrupted run would have.
`per_device_train_batch_size` counts packed sequences and is 1 under packing.

`training.packing: false`: a micro-batch is `per_device_train_batch_size` samples, right-padded.

Loss scaling (every channel): a micro-batch's loss is the token mean of its own terms, scaled by the
micro-batch's share of the optimizer step's segments, so a step's gradient is a segment-weighted mean
however the segments were grouped.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagectl.collate import Segment, collate_pack, collate_padded
from stagectl.learner.packs import PackRunner, StepAccumulator
from stagectl.learner.setup import LearnerState
from stagectl.packing import PackBuffer


class ChannelA:
    def __init__(self, state: LearnerState, runner: PackRunner) -> None:
        training = state.cfg.training
        self.state = state
        self.runner = runner
        self.packing = training.packing
        self.per_device = training.per_device_train_batch_size
        self.buffer_size = training.packing_buffer
        self.buffer: PackBuffer[int] = PackBuffer(runner.packing_length)
        for index in state.extra_state.get("rank_state", {}).get("a_buffer", []):
            self.buffer.add(int(index), state.encoder.channel_a_length(int(index)))

    def buffered_indices(self) -> list[int]:
        """The look-ahead buffer's sample indices, oldest first (saved per rank for an exact resume)."""
        return [index for index, _ in self.buffer.items]

    def next_micro_batches(self, gas: int) -> list[list[int]]:
        """The sample indices of the step's `gas` micro-batches (drawn now, so their share is known)."""
        if not self.packing:
            return [self.state.a_sampler.take(self.per_device) for _ in range(gas)]
        out = []
        for _ in range(gas):
            while len(self.buffer) < self.buffer_size:
                index = next(self.state.a_sampler)
                length = self.state.encoder.channel_a_length(index)
                if length > self.runner.packing_length:
                    raise ValueError(
                        f"sample {index} has {length} tokens > global_max_length {self.runner.packing_length}; "
                        "raise global_max_length or shorten the sample"
                    )
                self.buffer.add(index, length)
            out.append([index for index, _ in self.buffer.pop_pack()])
        return out

    def run(self, gas: int, acc: StepAccumulator) -> None:
        groups = self.next_micro_batches(gas)
        total = sum(len(g) for g in groups)
        for micro, indices in enumerate(groups):
            segments = [self.state.encoder.channel_a_segment(i) for i in indices]
            self.run_group(segments, scale=len(segments) / total, sync=micro == gas - 1, acc=acc)

    def run_group(
        self, segments: Sequence[Segment], *, scale: float, sync: bool, acc: StepAccumulator
    ) -> None:
        if self.packing:
            batch = collate_pack(segments, self.runner.base_model)
        else:
            batch = collate_padded(segments, self.state.encoder.pad_token_id)
        self.runner.run_batch(batch, scale=scale, sync=sync, acc=acc)
