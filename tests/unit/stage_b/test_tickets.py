"""Stage-B tickets: parsing, bad lines refused (or skipped on request) with file:line, a group labelled both ways
read as two tickets (upstream's `group_id::label`) and named, the empty set refused."""

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


def test_a_line_as_upstream_stage_a_writes_it_is_a_ticket() -> None:
    """Upstream's Stage-A writes `images` (the group's file names) with every record, and its ingest reads
    `label_source` / `label_timestamp`; each line was refused as `unknown key(s): images`."""
    line = (
        '{"group_id": "QC-BBU-20250101-1", "mission": "挡风板安装检查", "label": "fail", '
        '"images": ["QC-BBU-20250101-1_1.jpg", "QC-BBU-20250101-1_2.jpg"], '
        '"per_image": {"image_1": "挡风板/安装错误，需复核,备注:无", "image_2": "BBU设备/完整"}, '
        '"label_source": "human", "label_timestamp": "2025-01-01T08:00:00"}'
    )
    ticket = parse_ticket(json.loads(line))
    assert ticket.key == "QC-BBU-20250101-1::fail" and ticket.mission == "挡风板安装检查"
    assert [name for name, _ in ticket.per_image] == ["image_1", "image_2"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"images": "a.jpg"}, "images must be a list"),
        ({"images": [""]}, "images must be a list"),
        ({"label_source": 3}, "label_source must be a string"),
    ],
)
def test_upstream_optional_keys_are_checked(change: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_ticket({**GOOD, **change})


BAD_LINES = [
    json.dumps(GOOD),
    "{not json",
    "",
    json.dumps({**GOOD, "label": "maybe"}),
    json.dumps({**GOOD, "mission": "other"}),
    json.dumps(GOOD),  # duplicate key
    json.dumps({**GOOD, "group_id": "g2", "label": "pass"}),
]


def test_bad_lines_are_an_error_naming_each_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(BAD_LINES) + "\n")
    with pytest.raises(ValueError) as info:
        load_tickets([path], "m")
    message = str(info.value)
    assert message.startswith("tickets: 3 bad line(s) of mission 'm': ")
    assert f"{path}:2: not valid JSON" in message and f"{path}:4: label must be" in message
    assert f"{path}:6: duplicate ticket key 'g1::fail' (first at {path}:1)" in message
    assert "runner.bad_ticket_lines: skip" in message


def test_more_bad_lines_than_named_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([json.dumps(GOOD)] + ["{bad"] * 7) + "\n")
    with pytest.raises(ValueError, match=r"7 bad line\(s\).*:6: not valid JSON.*; and 2 more\. Fix"):
        load_tickets([path], "m")


def test_skip_bad_runs_without_them_and_lists_them(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(BAD_LINES) + "\n")
    result = load_tickets([path], "m", skip_bad=True)
    assert [t.key for t in result.tickets] == ["g1::fail", "g2::pass"]
    assert result.num_other_missions == 1
    assert [p.split(": ")[0] for p in result.problems] == [f"{path}:2", f"{path}:4", f"{path}:6"]
    assert "duplicate" in result.problems[2]


def test_one_group_with_both_labels_is_two_tickets_and_named_with_both_lines(tmp_path: Path) -> None:
    """Upstream keys tickets `group_id::label` (a group reviewed again after a fix carries both labels); such a
    set was refused as a whole ("a group has one label"), even with bad_ticket_lines: skip."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({**GOOD, "group_id": "g0"}) + "\n" + json.dumps(GOOD) + "\n")
    second.write_text("\n" + json.dumps({**GOOD, "label": "pass"}) + "\n")
    result = load_tickets([first, second], "m")
    assert [t.key for t in result.tickets] == ["g0::fail", "g1::fail", "g1::pass"]
    assert result.problems == []
    assert result.both_labels == [f"g1 ({first}:2 and {second}:2)"]


def test_the_same_group_id_in_another_mission_is_no_conflict(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "mission": "x", "label": "pass"}) + "\n")
    assert [t.key for t in load_tickets([path], "m").tickets] == ["g1::fail"]


def test_no_usable_ticket_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({**GOOD, "mission": "other"}) + "\n{bad\n")
    with pytest.raises(ValueError, match=r"no usable ticket of mission 'm'.*1 bad line"):
        load_tickets([path], "m", skip_bad=True)
    with pytest.raises(ValueError, match="cannot read"):
        load_tickets([tmp_path / "missing.jsonl"], "m")


def test_a_summary_with_a_unicode_line_separator_is_one_line(tmp_path: Path) -> None:
    # `json.dumps(..., ensure_ascii=False)` (upstream's writer) leaves U+2028 / U+0085 unescaped in the line
    odd = {**GOOD, "per_image": {"image_1": "red\u2028circle\x85near the top"}}
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(odd, ensure_ascii=False) + "\n" + json.dumps({**GOOD, "group_id": "g2"}) + "\n"
    )
    result = load_tickets([path], "m")
    assert [t.key for t in result.tickets] == ["g1::fail", "g2::fail"]
    assert result.tickets[0].per_image == (
        ("image_1", "red circle near the top"),
    )  # whitespace made single spaces


def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\r\n\r\n" + json.dumps({**GOOD, "group_id": "g2"})).encode()
    )
    assert [t.key for t in load_tickets([path], "m").tickets] == ["g1::fail", "g2::fail"]


def test_a_line_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    latin = json.dumps({**GOOD, "group_id": "g2", "per_image": {"image_1": "caf\u00e9"}}).replace(
        "\\u00e9", "\xe9"
    )
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + latin.encode("latin-1") + b"\n")
    with pytest.raises(ValueError) as info:
        load_tickets([path], "m")
    byte = latin.index("\xe9") + 1
    assert f"{path}:2: not UTF-8 text (byte {byte} of the line)" in str(info.value)
    result = load_tickets([path], "m", skip_bad=True)
    assert [t.key for t in result.tickets] == ["g1::fail"]


def test_a_lone_surrogate_or_json_nested_too_deeply_is_a_bad_line_named_with_its_file_and_line(
    tmp_path: Path,
) -> None:
    """`"\\ud83d"` without its pair (half an emoji, cut by a UTF-16 writer) is valid JSON but not text: the
    line loaded, and the model engine's tokenizer ended the run mid-batch with a TypeError traceback. A line
    nested deeper than the JSON reader recurses ended the start with a RecursionError traceback."""
    path = tmp_path / "t.jsonl"
    half_emoji = json.dumps({**GOOD, "group_id": "g2", "per_image": {"image_1": "red \ud83d"}})
    assert "\\ud83d" in half_emoji  # as the file holds it: an escape, the line itself is ASCII
    path.write_text("\n".join([json.dumps(GOOD), half_emoji, "[" * 100_000 + "]" * 100_000]) + "\n")
    with pytest.raises(ValueError) as info:
        load_tickets([path], "m")
    assert f"{path}:2: a string holds a lone surrogate escape" in str(info.value)
    assert f"{path}:3: not valid JSON (nested too deeply)" in str(info.value)
    result = load_tickets([path], "m", skip_bad=True)
    assert [t.key for t in result.tickets] == ["g1::fail"] and len(result.problems) == 2


def test_a_key_written_twice_is_a_bad_line_not_the_last_value(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    twice = json.dumps(GOOD)[:-1] + ', "label": "pass"}'
    path.write_text(json.dumps({**GOOD, "group_id": "g0"}) + "\n" + twice + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: key\(s\) written twice in one object: label"):
        load_tickets([path], "m")


def test_a_relative_path_that_is_not_found_names_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started from another directory than the config's misses its relative inputs; the error said only
    `No such file or directory`."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        load_tickets([Path("examples/tickets.jsonl")], "m")
    assert str(info.value) == (
        "tickets: cannot read examples/tickets.jsonl: No such file or directory (relative paths are read from the "
        f"working directory, {tmp_path})"
    )
    with pytest.raises(ValueError, match=r"cannot read /nowhere/t\.jsonl: No such file or directory$"):
        load_tickets([Path("/nowhere/t.jsonl")], "m")
