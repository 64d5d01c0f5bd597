"""Rendering HTML with jinja2 from the templates shipped in `stagectl/templates/` (package data): one
environment, autoescaped, undefined names an error (a template typo fails a test, not a page). A core module:
the eval gallery's index page (`evaluation`) and the report pages (`report`) both render with it."""

from __future__ import annotations

import base64
from functools import cache
from pathlib import Path
from typing import Any

import jinja2


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("stagectl", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, **context: Any) -> str:
    """`templates/<template>` rendered with `context`."""
    return _environment().get_template(template).render(**context)


def data_uri(path: Path) -> str:
    """A PNG inlined as a `data:` URI (the page then needs no file beside it)."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
