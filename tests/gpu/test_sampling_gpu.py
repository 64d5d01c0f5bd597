"""The hf server's per-request sampler on CUDA: it draws on the logits' device (nothing (B, V) goes to the host)
and, where each row's nucleus is a few tokens (as a trained model's mostly is), picks what it picks on the CPU
for the same seeds, on a Qwen-sized vocabulary."""

from __future__ import annotations

import torch

from stagectl.engines.sampling import PerRowSampler

VOCAB = 151_936


def _sampler() -> PerRowSampler:
    return PerRowSampler(list(range(8)), 0.7, 0.95, 0)


def test_draws_on_cuda_equal_draws_on_cpu_for_peaked_rows() -> None:
    scores = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)) * 8  # nuclei of a few tokens
    cpu, cuda = _sampler(), _sampler()
    ids = torch.zeros(1, 1, dtype=torch.long)
    for _ in range(10):
        on_cpu = cpu(ids, scores.clone())
        on_cuda = cuda(ids.cuda(), scores.cuda())
        assert on_cuda.device.type == "cuda"
        assert torch.equal(on_cuda.argmax(-1).cpu(), on_cpu.argmax(-1))


def test_a_wide_nucleus_is_sampled_on_cuda_inside_it() -> None:
    # flat rows: every nucleus is wider than the 64 candidates, so the whole vocabulary is sorted on the GPU
    scores = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1)).cuda()
    warped = torch.softmax(scores / 0.7, dim=-1)
    order = warped.argsort(dim=-1, descending=True)
    mass_before = warped.gather(-1, order).cumsum(-1) - warped.gather(-1, order)
    nucleus = torch.zeros_like(warped, dtype=torch.bool).scatter(-1, order, mass_before <= 0.95)
    sampler = _sampler()
    for _ in range(10):
        forced = sampler(torch.zeros(1, 1, dtype=torch.long, device="cuda"), scores.clone())
        assert (torch.isfinite(forced).sum(-1) == 1).all()
        assert nucleus.gather(-1, forced.argmax(-1, keepdim=True)).all()
