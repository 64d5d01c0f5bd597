"""Channel-A: teacher forcing on ground-truth answers, one pack per micro-step."""

from __future__ import annotations

from stagectl.learner.packs import PackRunner, StepAccumulator, make_packs
from stagectl.learner.setup import LearnerState


def run_channel_a(state: LearnerState, runner: PackRunner, gas: int, acc: StepAccumulator) -> None:
    """GAS micro-steps of `per_device_train_batch_size` A-stream samples each; the samples of a
    micro-step normally fit one pack (one forward/backward), else they take the fewest packs."""
    per_device = state.cfg.training.per_device_train_batch_size
    for micro in range(gas):
        segments = [state.encoder.channel_a_segment(i) for i in state.a_sampler.take(per_device)]
        packs = make_packs(segments, runner.packing_length)
        runner.run_packs(packs, segments_in_step=per_device * gas, acc=acc, sync_last=micro == gas - 1)
