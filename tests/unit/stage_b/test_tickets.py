"""Stage-B tickets: parsing, bad lines reported with file:line, the empty set refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagectl.stage_b.tickets import load_tickets, parse_ticket

GOOD = {"mission": "m", "group_id": "g1", "label": "fail", "per_image": {"image_10": "b", "image_2": "a  x"}}


def test_parse_ticket_orders_images_numerically() -> None:
    ticket = parse_ticket(GOOD)
    assert ticket.key == "g1::fail"
    assert ticket.per_image == (("image_2", "a x"), ("image_10", "b"))


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"label": "need review"}, "label"),
        ({"label": None}, "label"),
        ({"group_id": ""}, "group_id"),
        ({"group_id": "a::b"}, "group_id"),
        ({"per_image": {}}, "per_image"),
        ({"per_image": {"img1": "x"}}, "image_1"),
        ({"per_image": {"image_1": ""}}, "non-empty"),
        ({"mission": 3}, "mission"),
        ({"extra": 1}, "unknown"),
    ],
)
def test_parse_ticket_rejects(change: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_ticket({**GOOD, **change})


def test_load_tickets_skips_bad_lines_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps(GOOD),
        "{not json",
        "",
        json.dumps({**GOOD, "label": "maybe"}),
        json.dumps({**GOOD, "mission": "other"}),
        json.dumps(GOOD),  # duplicate key
        json.dumps({**GOOD, "group_id": "g2", "label": "pass"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    result = load_tickets([path], "m")
    assert [t.key for t in result.tickets] == ["g1::fail", "g2::pass"]
    assert result.num_other_missions == 1
    assert [p.split(": ")[0] for p in result.problems] == [f"{path}:2", f"{path}:4", f"{path}:6"]
    assert "duplicate" in result.problems[2]


def test_no_usable_ticket_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({**GOOD, "mission": "other"}) + "\n{bad\n")
    with pytest.raises(ValueError, match=r"no usable ticket of mission 'm'.*1 bad line"):
        load_tickets([path], "m")
    with pytest.raises(ValueError, match="cannot read"):
        load_tickets([tmp_path / "missing.jsonl"], "m")
