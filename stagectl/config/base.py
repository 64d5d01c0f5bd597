"""The strict base model every config section inherits from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys fail; attribute docstrings become field descriptions (shown by `--schema`)."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        frozen=False,
    )
