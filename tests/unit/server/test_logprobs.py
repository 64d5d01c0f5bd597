"""Per-token logprobs on the wire: the request field, the OpenAI/swift-shaped `choices[0].logprobs`
aligned with `token_ids` (fake engine behind the real service), the learner's view, the recorder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from stagectl.config.sampling import SamplingSpec
from stagectl.engines.fake import FakeEngine, fake_logprob
from stagectl.inference.requests import to_generation
from stagectl.models.generate import ChosenLogprobs
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.wire.protocol import InferBody, InferRequest, InferResponse, Message, RequestConfig


@pytest.fixture
def service(tmp_path) -> Iterator[RolloutService]:  # type: ignore[no-untyped-def]
    svc = RolloutService(FakeEngine(batch_wait_ms=0), ServerSettings())
    yield svc
    svc.close()


def _infer(service: RolloutService, **config: object) -> InferResponse:
    body = InferBody(
        infer_requests=[InferRequest(messages=[Message(role="user", content="hi")])],
        request_config=RequestConfig(max_tokens=16, temperature=0.0, seed=3, **config),  # type: ignore[arg-type]
    )
    (response,) = service.infer(body)
    return response


def test_logprobs_come_back_openai_shaped_and_aligned_with_token_ids(service: RolloutService) -> None:
    response = _infer(service, logprobs=True, return_details=True, stop=["=3"])
    choice = response.choices[0]
    assert choice.token_ids is not None and choice.logprobs is not None
    wire = response.model_dump(mode="json")["choices"][0]["logprobs"]
    assert len(wire["content"]) == len(choice.token_ids)  # cut at the stop string like the ids
    for entry, token_id in zip(wire["content"], choice.token_ids, strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == fake_logprob(token_id)
        assert entry["bytes"] == [token_id]
        assert entry["token"] == chr(token_id)
        assert entry["top_logprobs"] == []
    generation = to_generation(response)
    assert generation.logprobs == [fake_logprob(t) for t in choice.token_ids]


def test_no_logprobs_unless_asked(service: RolloutService) -> None:
    response = _infer(service, return_details=True)
    assert response.choices[0].logprobs is None
    assert "logprobs" not in response.model_dump(exclude_none=True)["choices"][0]
    assert to_generation(response).logprobs is None


def test_misaligned_logprobs_are_refused(service: RolloutService) -> None:
    response = _infer(service, logprobs=True, return_details=True)
    assert response.choices[0].logprobs is not None
    response.choices[0].logprobs.content.pop()
    with pytest.raises(ValueError, match="aligned"):
        to_generation(response)


def test_request_config_carries_logprobs_both_ways() -> None:
    spec = SamplingSpec(max_new_tokens=5, logprobs=True)
    config = RequestConfig.from_sampling(spec, seed=None)
    assert config.logprobs is True
    assert config.sampling() == spec
    assert RequestConfig().sampling().logprobs is False


def test_recorder_keeps_the_chosen_tokens_log_softmax() -> None:
    recorder = ChosenLogprobs()
    steps = [
        torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]),
        torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 5.0]]),
    ]
    chosen = torch.tensor([[2, 0], [0, 2]])  # (B, T): row 0 picks 2 then 0, row 1 picks 0 then 2
    for t, scores in enumerate(steps):
        prefix = chosen[:, :t] if t else torch.zeros(2, 0, dtype=torch.long)
        out = recorder(torch.cat([torch.zeros(2, 1, dtype=torch.long), prefix], dim=1), scores)  # type: ignore[arg-type]
        assert out is scores  # it only watches
    logprobs = recorder.finish(chosen)
    expected = [[float(torch.log_softmax(steps[t][b], -1)[chosen[b, t]]) for t in range(2)] for b in range(2)]
    for row, want in zip(logprobs, expected, strict=True):
        assert row == pytest.approx(want)
