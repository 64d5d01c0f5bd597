"""The one seed recipe: a seed is a stable hash of named integer coordinates.

`derive_seed(a, b, ...)` is the first 31 bits of sha256("a:b:..."): independent of rank count,
process and platform, never correlated between neighbouring coordinates (unlike `seed + step`), and
small enough for every sampler (torch, vLLM, numpy). Within one `/infer/` call the wire rule adds
the request's index to the call's base seed (`wire.protocol`).
"""

from __future__ import annotations

import hashlib


def derive_seed(*coordinates: int) -> int:
    text = ":".join(str(int(c)) for c in coordinates)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") % 2**31
