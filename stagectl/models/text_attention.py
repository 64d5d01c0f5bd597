"""Variable-length causal attention for the language model's packed sequences
(`training.kernels.packed_attention: varlen`).

A pack holds many segments (~24 of ~170 tokens in the GPU bench's 4,096-token packs) whose text positions
restart at 0 in every segment. Under `sdpa`, transformers turns those positions into a dense (L, L)
block-diagonal causal mask, and PyTorch's masked attention kernels compute every block of it, ~24x the
useful work at that packing. `TEXT_VARLEN` finds the segments from the positions instead (the same rule
transformers' flash path uses: a segment starts where the position is 0) and runs one causal attention per
segment: PyTorch's flash `varlen_attn` in one call on CUDA in bf16/fp16, else one causal
`scaled_dot_product_attention` per distinct segment length (`vision_attention.equal_length_batches`).
Anything that is not one pack (a padded batch, a KV cache during generation, no positions) goes to
transformers' own sdpa with the mask transformers built, so evaluation and generation are unchanged.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from stagectl.models.vision_attention import _torch_varlen, equal_length_batches

TEXT_VARLEN = "stagectl_varlen_text"  # no "flash" in the name: transformers keeps building sdpa's masks


def segment_starts(position_ids: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """cu_seqlens (N + 1,) int32 of one packed sequence from its text positions (1, L); None when the
    positions do not describe one pack of `length` tokens starting at position 0."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length):
        return None
    positions = position_ids[0]
    if int(positions[0]) != 0:  # a continuation (cached decoding, an offset prompt): not a pack
        return None
    starts = (positions == 0).nonzero().flatten()
    end = torch.tensor([length], device=positions.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


@dataclass(frozen=True)
class _LastPack:
    """The segments of the last pack seen. Every layer of one forward (and the backward's recompute under
    checkpointing) gets the same position tensor, so the segments, and the host syncs that find them, are
    computed once per forward instead of once per layer. Frozen and swapped whole (one reference
    assignment), so a forward in another thread never reads one pack's positions with another's segments."""

    positions: torch.Tensor | None = None
    length: int = 0
    cu: torch.Tensor | None = None
    max_len: int = 0


_last_pack = _LastPack()


def packed_segments(position_ids: torch.Tensor | None, length: int) -> tuple[torch.Tensor | None, int]:
    """`segment_starts` and the longest segment's length, remembered for the position tensor of the last call."""
    global _last_pack
    last = _last_pack
    if position_ids is None or last.positions is not position_ids or last.length != length:
        cu = segment_starts(position_ids, length)
        max_len = 0 if cu is None else int((cu[1:] - cu[:-1]).max())
        last = _LastPack(position_ids, length, cu, max_len)
        _last_pack = last
    return last.cu, last.max_len


def varlen_text_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query (B, H, Lq, D), key/value (B, H_kv, Lk, D); returns (B, Lq, H, D) as transformers expects."""
    cu, max_len = None, 0
    if query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        cu, max_len = packed_segments(position_ids, query.shape[2])
    if cu is None or dropout:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out, None
    varlen_attn = _torch_varlen()
    if varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (T, H, D)
        causal = _causal_gqa_kwargs(varlen_attn)
        if "enable_gqa" not in causal and k.shape[1] != q.shape[1]:  # older torch: expand the kv heads
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **causal)
        return out.unsqueeze(0), None
    return equal_length_batches(query, key, value, cu, scaling, causal=True), None


@functools.cache
def _causal_gqa_kwargs(varlen_attn: Any) -> dict[str, Any]:
    """Causal, grouped-query keywords for the installed torch's `varlen_attn`: 2.9-2.10 took `is_causal`,
    later versions `window_size=(-1, 0)`; `enable_gqa` only where the signature has it (else the caller
    expands the kv heads). Each is read from the signature on its own: the GPU machine's torch is older
    than this machine's, and a version with `window_size` but no `enable_gqa` must work too."""
    parameters = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    if "enable_gqa" in parameters:
        kwargs["enable_gqa"] = True
    return kwargs


def use_varlen_text_attention(model: torch.nn.Module) -> None:
    """Switch the language model of `model` to `TEXT_VARLEN`; `ValueError` unless it runs sdpa now (the
    fallback is sdpa, so another implementation would silently change what non-packed batches compute)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    text = model.config.get_text_config()  # type: ignore[union-attr, operator]
    if text._attn_implementation != "sdpa":
        raise ValueError(
            "training.kernels.packed_attention: varlen needs the language model on sdpa (model.attn_implementation "
            f"sdpa or unset), but it runs {text._attn_implementation!r}"
        )
    AttentionInterface.register(TEXT_VARLEN, varlen_text_attention)
    AttentionMaskInterface.register(TEXT_VARLEN, sdpa_mask)  # the fallback's masks, built as for sdpa
    text._attn_implementation = TEXT_VARLEN
