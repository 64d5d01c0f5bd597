"""The learner model's optional faster paths (`training.kernels`), applied once after loading.

- `use_liger`: liger-kernel's RMSNorm, SwiGLU and rotary triton kernels patched into the model (CUDA only;
  the LM head's fused cross-entropy is ours, `stagectl.models.linear_ce`, so liger's is left off).
- `use_varlen_text_attention` (`stagectl.models.text_attention`): the packed language model's attention
  per segment instead of under a dense block-diagonal mask.
- `compile_blocks`: `torch.compile` of each decoder layer and vision block, in place (`Module.compile`:
  the parameters and their names stay, so checkpoints, weight syncs and FSDP2 see the same model).

Each is off by default; `tests/unit/models/test_speedups.py` checks each against the eager path.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from stagectl.models.text_attention import use_varlen_text_attention

LIGER_MISSING = (
    "training.kernels.liger needs liger-kernel (pip install 'stagectl[liger]'; triton kernels, CUDA only)"
)


def liger_problem(device: torch.device) -> str | None:
    """Why liger-kernel cannot run here (None: it can): not installed, or not a CUDA device."""
    if importlib.util.find_spec("liger_kernel") is None:
        return LIGER_MISSING
    if device.type != "cuda":
        return f"training.kernels.liger: liger-kernel's triton kernels run on CUDA only, the learner is on {device}"
    return None


def use_liger(model: Any, device: torch.device) -> None:
    """Patch liger's RMSNorm, SwiGLU and rotary kernels into `model` (and its classes); `ValueError`
    naming the reason where that cannot run."""
    problem = liger_problem(device)
    if problem is not None:
        raise ValueError(problem)
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:  # liger would log it and patch nothing
        raise ValueError(f"training.kernels.liger: liger-kernel has no kernels for model_type {model_type!r}")
    _apply_liger_kernel_to_instance(
        model=model,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )


def transformer_blocks(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of the language model and the blocks of the vision tower (if any)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    blocks: list[torch.nn.Module] = list(base.get_decoder().layers)
    vision = getattr(getattr(base, "model", None), "visual", None)
    if vision is not None:
        blocks += list(vision.blocks)
    return blocks


def compile_blocks(model: Any, backend: str = "inductor") -> int:
    """`torch.compile` every block of `transformer_blocks(model)` in place; returns how many. `backend`:
    torch.compile's (the tests use `aot_eager`, which checks the traced graphs without generating code)."""
    blocks = transformer_blocks(model)
    # identical blocks share one compiled graph when dynamo treats their parameters as inputs (the
    # default since torch 2.5); the limit still leaves room for a recompile per distinct shape and block
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 + len(blocks))
    for block in blocks:
        block.compile(backend=backend, dynamic=None)
    return len(blocks)


def apply_speedups(
    model: Any,
    device: torch.device,
    *,
    liger: bool,
    packed_attention: str,
    torch_compile: bool,
    compile_backend: str = "inductor",
) -> list[str]:
    """Apply the chosen paths in the order that composes (kernels patched in before the blocks are traced);
    returns what was applied, for the start-up line."""
    applied = []
    if liger:
        use_liger(model, device)
        applied.append("liger rms_norm/swiglu/rope")
    if packed_attention == "varlen":
        use_varlen_text_attention(model)
        applied.append("varlen packed attention")
    elif packed_attention != "mask":
        raise ValueError(
            f"training.kernels.packed_attention must be mask or varlen, got {packed_attention!r}"
        )
    if torch_compile:
        applied.append(f"torch.compile x{compile_blocks(model, compile_backend)} blocks")
    return applied
