"""The `hf` engine's `kv_cache: static` (`rollout_server.hf_kv_cache`): greedy tokens equal today's dynamic
cache for a batch of concurrent image requests of different prompt lengths (left padding), and the
requests are still batched into one generate call."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.models.sampling import SamplingSpec
from stagectl.rollout.engine import EngineRequest
from stagectl.rollout.server.engines.hf import HFEngine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_bundle("builtin:tiny-qwen2.5-vl")


def _requests() -> list[EngineRequest]:
    rng = np.random.default_rng(0)
    spec = SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find every object."}]}
    ]
    sizes = ((56, 56), (84, 112), (56, 84))  # different image-token counts: a left-padded batch
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    return [EngineRequest(messages, [image], spec, seed=None) for image in images]


def _greedy(bundle: ModelBundle, kv_cache: str) -> tuple[list[list[int]], dict[int, int], set[str]]:
    engine = HFEngine(bundle, model_name="tiny", max_batch_size=8, batch_wait_ms=200, kv_cache=kv_cache)  # type: ignore[arg-type]
    caches: set[str] = set()  # the cache class each forward decoded with

    def record(_module: object, _args: object, kwargs: dict) -> None:
        caches.add(type(kwargs.get("past_key_values")).__name__)

    hook = bundle.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with ThreadPoolExecutor(3) as pool:  # concurrent callers, one request each
            results = list(pool.map(lambda r: engine.generate([r])[0], _requests()))
        return [r.token_ids for r in results], engine.batch_sizes(), caches
    finally:
        hook.remove()
        engine.close()


def test_static_cache_greedy_tokens_equal_the_dynamic_cache_and_requests_still_batch(
    bundle: ModelBundle,
) -> None:
    dynamic, _, dynamic_caches = _greedy(bundle, "dynamic")
    static, batch_sizes, static_caches = _greedy(bundle, "static")
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
