"""The `hf` engine's `kv_cache: static` (`rollout_server.hf_kv_cache`): greedy tokens equal today's dynamic
cache for a batch of concurrent image requests of different prompt lengths (left padding), and the
requests are still batched into one generate call."""

from __future__ import annotations

import pytest

from stagectl.config.sampling import SamplingSpec
from stagectl.models.loading import ModelBundle, load_bundle
from tests.helpers import greedy_engine_ids


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_bundle("builtin:tiny-qwen2.5-vl")


def test_static_cache_greedy_tokens_equal_the_dynamic_cache_and_requests_still_batch(
    bundle: ModelBundle,
) -> None:
    dynamic, _, dynamic_caches = greedy_engine_ids(bundle, "dynamic")
    static, batch_sizes, static_caches = greedy_engine_ids(bundle, "static")
    assert dynamic_caches == {"DynamicCache"} and static_caches == {"StaticCache"}
    assert all(len(ids) > 0 for ids in dynamic)
    assert static == dynamic
    assert max(batch_sizes) > 1  # concurrent requests went through one generate call


def test_unknown_kv_cache_is_refused(bundle: ModelBundle) -> None:
    from stagectl.models.generate import PromptInputs, generate_batch

    with pytest.raises(ValueError, match="kv_cache must be dynamic or static"):
        generate_batch(
            bundle.model, [PromptInputs([1, 2, 3])], SamplingSpec(max_new_tokens=2), stop_token_ids=[0],
            pad_token_id=0, kv_cache="paged",  # type: ignore[arg-type]
        )  # fmt: skip
