"""The jinja2 environment: the shipped templates load as package data, text is escaped, and a name the
template uses but the caller did not give is an error, not an empty string."""

from __future__ import annotations

import jinja2
import pytest

from stagectl.templating import render


def test_templates_escape_text_and_refuse_missing_names() -> None:
    page = render(
        "gallery_index.html.j2",
        entries=[],
        num_images=3,
        legend=[{"what": "<b>", "colour": "#000000", "line": "solid"}],
    )
    assert (
        "<!DOCTYPE html>" in page
        and "&lt;b&gt;" in page
        and "<b>" not in page.split("<body>")[1].split("<p>")[0]
    )
    with pytest.raises(jinja2.UndefinedError, match="legend"):
        render("gallery_index.html.j2", entries=[], num_images=3)
