"""`SamplingSpec` is built in one place per config shape: Channel-B rollouts, eval rollouts, Stage-B."""

from __future__ import annotations

from stagectl.config.rollout import DecodingConfig, RolloutMatchingConfig
from stagectl.config.sampling import SamplingSpec
from stagectl.config.stage_b import ReflectionConfig, SamplerEntry

RM = RolloutMatchingConfig(
    max_new_tokens=64, repetition_penalty=1.1, decoding=DecodingConfig(temperature=0.5, top_p=0.8, top_k=20)
)


def test_channel_b_samples_by_rollout_matching() -> None:
    assert SamplingSpec.for_channel_b(RM) == SamplingSpec(
        max_new_tokens=64, temperature=0.5, top_p=0.8, top_k=20, repetition_penalty=1.1
    )
    assert SamplingSpec.for_channel_b(RM, logprobs=True).logprobs
    # the defaults: near-greedy (temperature 0.01, top_p 0.95), 256 tokens, no penalty
    assert SamplingSpec.for_channel_b(RolloutMatchingConfig()) == SamplingSpec(
        max_new_tokens=256, temperature=0.01, top_p=0.95, top_k=0, repetition_penalty=1.0
    )


def test_eval_samples_by_its_own_decoding_with_channel_bs_length_and_penalty() -> None:
    decoding = DecodingConfig(temperature=0.3, top_p=0.7, top_k=-1)  # -1 is read as "off"
    assert SamplingSpec.for_eval(RM, decoding) == SamplingSpec(
        max_new_tokens=64, temperature=0.3, top_p=0.7, top_k=0, repetition_penalty=1.1, logprobs=True
    )
    # without `data.eval`: greedy, never Channel-B's sampling
    assert SamplingSpec.for_eval(RM, None) == SamplingSpec(
        max_new_tokens=64, temperature=0.0, top_p=0.95, top_k=0, repetition_penalty=1.1, logprobs=True
    )


def test_stage_b_samples_by_a_grid_entry_or_the_reflection_config() -> None:
    entry = SamplerEntry(temperature=0.9, top_p=0.6, max_new_tokens=32, seed=5)
    assert SamplingSpec.for_stage_b(entry) == SamplingSpec(max_new_tokens=32, temperature=0.9, top_p=0.6)
    reflection = ReflectionConfig(max_new_tokens=100, temperature=0.2)
    assert SamplingSpec.for_stage_b(reflection) == SamplingSpec(
        max_new_tokens=100, temperature=0.2, top_p=1.0
    )
