"""Block-diagonal attention for the Qwen-VL vision towers in one call per layer.

Under `sdpa`, transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision attention splits the patches at every
window / image boundary and calls attention once per piece, from Python: a pack of 16 images runs ~1,900
attention calls per step, and on an H100 the vision tower took half the step, launch-bound
(BENCHMARKS.md, GPU section). Names containing "flash" take transformers' `cu_seqlens` path instead, so this
module registers one (`VARLEN`) that computes the same block-diagonal attention: PyTorch's own flash
`varlen_attn` in one call on CUDA in bf16/fp16, else one `scaled_dot_product_attention` per distinct piece
length over a batch of equal-length pieces. The language model keeps its own implementation; only the
vision config is switched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VARLEN = "stagectl_flash_varlen_vision"  # "flash" in the name selects transformers' cu_seqlens path
_SPLIT_BY_DEFAULT = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # vision attention loops over pieces under sdpa


def _torch_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return varlen_attn


def varlen_vision_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """query/key/value (1, H, T, D), pieces given by `cu_seq_lens_q` (N + 1,); returns (1, T, H, D)."""
    if cu_seq_lens_q is None or query.shape[0] != 1 or attention_mask is not None or dropout:
        raise ValueError(
            "the varlen vision attention takes one packed sequence with cu_seqlens and no dropout"
        )
    cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    varlen_attn = _torch_varlen()
    if varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        max_len = max_length_q if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (T, H, D)
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling)
        return out.unsqueeze(0), None
    return equal_length_batches(query, key, value, cu, scaling), None


def equal_length_batches(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    scaling: float | None,
    causal: bool = False,
) -> torch.Tensor:
    """The pieces grouped by length, one `scaled_dot_product_attention` per distinct length (a window
    size, an image size) over a batch of pieces: a few calls, and never attention across the whole
    sequence (a dense block-diagonal mask would cost (sum of lengths)^2). query (1, H, T, D), key/value
    (1, H_kv, T, D) (grouped-query heads when H_kv < H); `causal`: each piece attends causally (the
    language model's packed segments). Returns (1, T, H, D)."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    starts = cu[:-1].long()
    outputs, order = [], []
    for length in sorted(set(lengths)):
        pieces = torch.tensor([k for k, n in enumerate(lengths) if n == length], device=query.device)
        index = (starts[pieces, None] + torch.arange(length, device=query.device)).reshape(-1)
        q, k, v = (
            t[0][:, index].unflatten(1, (len(pieces), length)).transpose(0, 1) for t in (query, key, value)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, scale=scaling, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
        )  # (pieces, H, length, D)
        outputs.append(out.transpose(0, 1).flatten(1, 2))  # (H, pieces * length, D)
        order.append(index)
    position = torch.cat(order)
    inverse = torch.empty_like(position)
    inverse[position] = torch.arange(len(position), device=position.device)
    return torch.cat(outputs, dim=1)[:, inverse].transpose(0, 1).unsqueeze(0).contiguous()  # (1, T, H, D)


def use_varlen_vision_attention(model: torch.nn.Module) -> bool:
    """Switch a Qwen-VL vision tower that would split its attention (sdpa, eager) to `VARLEN`; the
    result is the same attention. False (nothing changed) for other models or a flash implementation."""
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None or getattr(config, "model_type", None) not in _SPLIT_BY_DEFAULT:
        return False
    if vision._attn_implementation not in (None, "sdpa"):
        return False  # eager (the reference) and flash_attention_2 stay as asked
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_vision_attention)
    vision._attn_implementation = VARLEN
    return True


def describe_attention(model: Any) -> str:
    """`sdpa`, or `sdpa (vision: one varlen call per layer)`: what the start-up line names."""
    config = model.config
    text = config.get_text_config()._attn_implementation
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return str(text)
    name = vision._attn_implementation
    return f"{text} (vision: {'one varlen call per layer' if name == VARLEN else name})"
