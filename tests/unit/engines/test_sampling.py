"""Per-request seeded sampling: temperature, top-k and top-p by inverse CDF, and batch-independent draws."""

from __future__ import annotations

import pytest
import torch

from stagectl.engines.sampling import PerRowSampler, sample_tokens

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def _draw(
    scores: torch.Tensor, u: float, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> int:
    return int(sample_tokens(scores, torch.tensor([u]), temperature, top_p, top_k)[0])


def test_without_top_p_a_uniform_picks_by_cumulative_probability_in_vocabulary_order() -> None:
    # cumulative 0.5, 0.8, 0.95, 1.0
    assert [_draw(PROBS.log(), u) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.96)] == [0, 0, 1, 1, 2, 3]


def test_top_p_keeps_the_smallest_nucleus_and_renormalises_it() -> None:
    # top_p 0.7: 0.5 < 0.7, so 0.3 joins; the kept mass 0.8 is split 0.625 / 0.375
    picks = [_draw(PROBS.log(), u, top_p=0.7) for u in (0.0, 0.6, 0.65, 0.999)]
    assert picks == [0, 0, 1, 1]
    assert {_draw(PROBS.log(), u, top_p=0.01) for u in (0.0, 0.5, 0.999)} == {0}  # the best always stays


def test_top_k_keeps_the_k_best_and_their_ties() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    picks = {_draw(logits, u / 100, top_k=2) for u in range(100)}
    assert picks == {1, 3}
    tied = torch.tensor([[1.0, 5.0, 4.0, 4.0, 2.0]])
    assert {_draw(tied, u / 100, top_k=2) for u in range(100)} == {1, 2, 3}


def test_temperature_scales_the_logits() -> None:
    logits = torch.tensor([[2.0, 4.0]])  # / 2: softmax([1, 2]) = [0.269, 0.731]
    assert [_draw(logits, u, temperature=2.0) for u in (0.25, 0.28)] == [0, 1]
    assert {_draw(logits, u, temperature=0.01) for u in (0.0, 0.999)} == {1}


def test_the_candidate_path_and_the_full_sort_pick_the_same_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(6, 500, generator=gen) * 8  # nuclei of a few tokens: inside 16 candidates
    flat = torch.randn(6, 500, generator=gen)  # nuclei of hundreds of tokens: the whole row is sorted
    for scores in (peaked, flat, torch.cat([peaked, flat])):
        for _ in range(20):
            u = torch.rand(scores.shape[0], generator=gen)
            few = sample_tokens(scores, u, 1.0, 0.9, 0, candidates=16)
            assert torch.equal(few, sample_tokens(scores, u, 1.0, 0.9, 0, candidates=500))


def test_a_uniform_at_the_top_never_picks_a_removed_token() -> None:
    below_one = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    assert _draw(PROBS.log(), below_one, top_p=0.7) == 1
    masked = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    assert _draw(masked, below_one) == 1


def test_draws_follow_the_probabilities() -> None:
    sampler = PerRowSampler([3], 1.0, 1.0, 0)
    scores = PROBS.log()
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sampler(torch.zeros(1, 1, dtype=torch.long), scores.clone()).argmax(-1)] += 1
    assert torch.allclose(counts / 4000, PROBS[0], atol=0.03)


def _draws(sampler: PerRowSampler, scores: torch.Tensor, steps: int) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in range(scores.shape[0])]
    for _ in range(steps):
        forced = sampler(torch.zeros(1, 1, dtype=torch.long), scores.clone())
        for r, token in enumerate(forced.argmax(-1).tolist()):
            assert torch.isfinite(forced[r]).sum() == 1  # exactly one token allowed
            rows[r].append(token)
    return rows


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_row_draws_the_same_alone_or_batched(top_p: float) -> None:
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    batched = _draws(PerRowSampler([7, 8, 9], 1.0, top_p, 0), scores, steps=20)
    alone = _draws(PerRowSampler([8], 1.0, top_p, 0), scores[1:2], steps=20)
    assert batched[1] == alone[0]
    assert batched[0] != batched[1]  # different seeds, different draws


def test_sampler_refuses_greedy() -> None:
    with pytest.raises(ValueError, match="temperature > 0"):
        PerRowSampler([1], 0.0, 1.0, 0)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300])
@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 0), (0.9, 0), (1.0, 2)])
def test_a_temperature_so_small_that_logits_overflow_draws_the_greedy_token(
    temperature: float, top_p: float, top_k: int
) -> None:
    """`scores / temperature` past float32's range (+inf; NaN once the temperature rounds to 0) made softmax NaN,
    and every row drew token 0 whatever its scores: a 200 answering `!!!!` (Qwen's token 0) to every request
    with such a temperature."""
    scores = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, -2.0, -0.5, -1.0]])
    for u in (0.0, 0.5, 0.99):
        assert sample_tokens(scores, torch.tensor([u, u]), temperature, top_p, top_k).tolist() == [1, 0]


def test_an_infinite_score_is_drawn_not_token_0() -> None:
    """A tiny `repetition_penalty` divides a positive score past float32's range before the sampler sees it."""
    scores = torch.tensor([[1.0, float("inf"), 2.0, -1.0], [0.5, -2.0, float("inf"), float("inf")]])
    for u, second in ((0.1, 2), (0.9, 3)):  # two infinite scores share the row evenly
        assert sample_tokens(scores, torch.tensor([u, u]), 1.0, 1.0, 0).tolist() == [1, second]
