"""Channel-A: teacher forcing on ground-truth answers, one micro-batch per micro-step.

`training.packing: true` (the upstream's way): a micro-batch is ONE packed sequence of at most
`packing_length` tokens, chosen from this rank's look-ahead buffer of A-stream samples
(`training.packing_buffer` of them): the oldest buffered sample, then the largest others that still fit
(`packing.select_pack`). The buffer is topped up from the A stream before every pack, so the packs are a
pure function of the stream (seed, rank, world size); the buffer's sample indices and stream positions
are saved with each checkpoint, so a resumed run packs exactly what the uninterrupted run would have.
`per_device_train_batch_size` counts packed sequences and is 1 under packing.

`training.packing: false`: a micro-batch is `per_device_train_batch_size` samples, right-padded.

Loss scaling (every channel): a micro-batch's loss is the token mean of its own terms, scaled by the
micro-batch's share of the optimizer step's segments, so a step's gradient is a segment-weighted mean
however the segments were grouped.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagectl.collate import Segment, collate_pack, collate_padded
from stagectl.data.sampler import ShardedSampler
from stagectl.learner.packs import PackRunner, StepAccumulator
from stagectl.learner.setup import LearnerState
from stagectl.packing import PackBuffer


class ChannelA:
    def __init__(self, state: LearnerState, runner: PackRunner) -> None:
        training = state.plan.training
        self.state = state
        self.runner = runner
        self.packing = training.packing
        self.per_device = training.per_device_train_batch_size
        self.buffer_size = training.packing_buffer
        # keys: (sample index, its position in this rank's A stream)
        self.buffer: PackBuffer[tuple[int, int]] = PackBuffer(runner.packing_length)
        rank_state = state.extra_state.get("rank_state", {})
        indices = [int(i) for i in rank_state.get("a_buffer", [])]
        positions = rank_state.get("a_buffer_pos")  # absent from checkpoints before the audit trail
        if positions is None:
            positions = recover_positions(state.a_sampler, indices)
        for index, pos in zip(indices, positions, strict=True):
            self.buffer.add((index, int(pos)), state.encoder.channel_a_length(index))

    def buffer_state(self) -> dict[str, list[int]]:
        """The look-ahead buffer's sample indices and stream positions, oldest first (saved per rank for
        an exact resume)."""
        return {
            "a_buffer": [index for (index, _), _ in self.buffer.items],
            "a_buffer_pos": [pos for (_, pos), _ in self.buffer.items],
        }

    def next_micro_batches(self, gas: int) -> list[list[tuple[int, int]]]:
        """The (sample index, stream position) pairs of the step's `gas` micro-batches (drawn now, so
        their share is known)."""
        sampler = self.state.a_sampler
        if not self.packing:
            out = []
            for _ in range(gas):
                first = sampler.num_consumed
                out.append([(index, first + k) for k, index in enumerate(sampler.take(self.per_device))])
            return out
        out = []
        for _ in range(gas):
            while len(self.buffer) < self.buffer_size:
                pos = sampler.num_consumed
                index = next(sampler)
                length = self.state.encoder.channel_a_length(index)
                if length > self.runner.packing_length:
                    raise ValueError(
                        f"sample {index} has {length} tokens > global_max_length {self.runner.packing_length}; "
                        "raise global_max_length or shorten the sample"
                    )
                self.buffer.add((index, pos), length)
            out.append([key for key, _ in self.buffer.pop_pack()])
        return out

    def run(self, gas: int, acc: StepAccumulator) -> None:
        groups = self.next_micro_batches(gas)
        total = sum(len(g) for g in groups)
        for micro, group in enumerate(groups):
            segments = [self.state.encoder.channel_a_segment(index) for index, _ in group]
            self.run_group(segments, scale=len(segments) / total, sync=micro == gas - 1, acc=acc)
            acc.samples += [("A", index, pos, None, None) for index, pos in group]

    def run_group(
        self, segments: Sequence[Segment], *, scale: float, sync: bool, acc: StepAccumulator
    ) -> None:
        if self.packing:
            batch = collate_pack(segments, self.runner.base_model)
        else:
            batch = collate_padded(segments, self.state.encoder.pad_token_id)
        self.runner.run_batch(batch, scale=scale, sync=sync, acc=acc)


def recover_positions(sampler: ShardedSampler, indices: list[int]) -> list[int]:
    """Stream positions of buffered samples saved without them (checkpoints before the audit trail): the
    buffer is oldest-first and was drawn from positions below `num_consumed`, so match from the newest
    back (the stream is a pure function of its position)."""
    positions: list[int] = []
    pos = sampler.num_consumed
    for index in reversed(indices):
        pos -= 1
        while (
            pos >= 0 and sampler.epoch_share(pos // sampler.share_length)[pos % sampler.share_length] != index
        ):
            pos -= 1
        if pos < 0:
            raise ValueError(
                f"checkpoint rank state: buffered sample {index} is not in the A stream before "
                f"position {sampler.num_consumed}"
            )
        positions.append(pos)
    return positions[::-1]
