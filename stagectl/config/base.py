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
        # JSON has no infinity: a `.inf` key (a timeout that never fires) is written "Infinity" in plan files, not null
        ser_json_inf_nan="strings",
    )
