"""The dtype spellings users type (`bf16`, `fp16`, `half`, `fp32`, `float`, `torch.bfloat16`, ...) mapped to one
canonical name, for every config key and CLI flag that takes a dtype. No torch import: the CLI checks a
flag before it loads anything."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

CANONICAL = ("float32", "bfloat16", "float16")
ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}
SPELLINGS = "float32 (fp32, float), bfloat16 (bf16) or float16 (fp16, half)"
_SHORT = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def canonical_dtype(text: str) -> str:
    """`bf16` -> `bfloat16`, `torch.half` -> `float16`, ...; `ValueError` naming the spellings otherwise."""
    key = text.strip().lower().removeprefix("torch.")
    if key not in ALIASES:
        raise ValueError(f"unknown dtype {text!r}; use {SPELLINGS}")
    return ALIASES[key]


def _storage(value: Any) -> Any:
    return canonical_dtype(value) if isinstance(value, str) else value


def _engine(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _storage(value)


def _mixed_precision(value: Any) -> Any:
    """`no` (YAML reads a bare `no` as false), or a compute dtype in any spelling -> `bf16` / `fp16`."""
    if value is False or (isinstance(value, str) and value.strip().lower() in ("no", "none", "off")):
        return "no"
    if isinstance(value, str):
        try:
            return _SHORT[canonical_dtype(value)]
        except ValueError:
            raise ValueError(
                f"unknown compute dtype {value!r}; use no (float32), bf16 (bfloat16) or fp16 (float16, half)"
            ) from None
    return value


StorageDtype = Annotated[Literal["float32", "bfloat16", "float16"], BeforeValidator(_storage)]
EngineDtype = Annotated[Literal["auto", "float32", "bfloat16", "float16"], BeforeValidator(_engine)]
MixedPrecision = Annotated[Literal["no", "bf16", "fp16"], BeforeValidator(_mixed_precision)]
