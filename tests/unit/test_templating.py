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
        intro="3 of 3 <i>images</i>",
        legend=[{"what": "<b>", "colour": "#000000", "line": "solid"}],
    )
    # the legend is drawn only with entries; the intro is text, escaped
    assert (
        "<!DOCTYPE html>" in page and "<p>3 of 3 &lt;i&gt;images&lt;/i&gt;</p>" in page and "<i>" not in page
    )
    with pytest.raises(jinja2.UndefinedError, match="intro"):
        render("gallery_index.html.j2", entries=[], legend=[])
