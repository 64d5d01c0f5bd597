"""Stage-B guidance: the file model, reflection operations, and crash-safe saving."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from stagectl.stage_b.guidance import Guidance, next_learnable_key, parse_guidance
from stagectl.stage_b.guidance_ops import apply_operations
from stagectl.stage_b.guidance_store import GuidanceStore, read_guidance_file
from stagectl.stage_b.prompts import ReflectionRecord
from stagectl.stage_b.reflection import ReflectionResult, reflection_row
from stagectl.stage_b.tickets import Ticket

NOW = "2026-11-21T12:00:00Z"
BASE = Guidance(
    step=3,
    updated_at="2026-11-20T00:00:00Z",
    experiences={"G0": "focus", "G1": "red means fail", "G2": "blue is fine", "S1": "people rule"},
)
EVIDENCE = ["g1::fail", "g2::pass"]


def apply(ops: Any, guidance: Guidance = BASE, max_operations: int = 3, evidence: list[str] = EVIDENCE):
    return apply_operations(ops, guidance, evidence, max_operations, NOW)


# ------------------------------------------------------------------ file model


def test_parse_guidance_orders_and_normalises() -> None:
    g = parse_guidance(
        {"step": 2, "updated_at": "t", "experiences": {"S9": "x", "G10": "a  \n b", "G0": "f", "G2": "c"}}
    )
    assert list(g.experiences) == ["G0", "G2", "G10", "S9"]
    assert g.experiences["G10"] == "a b" and g.step == 2
    assert next_learnable_key(g.experiences) == "G11"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"step": 0, "updated_at": "t", "experiences": {"G1": "x"}}, "G0"),
        ({"step": -1, "updated_at": "t", "experiences": {"G0": "x"}}, "step"),
        ({"step": 0, "updated_at": "t", "experiences": {"G0": "x", "X1": "y"}}, "X1"),
        ({"step": 0, "updated_at": "t", "experiences": {"G0": ""}}, "non-empty"),
        ({"step": 0, "updated_at": "t", "experiences": []}, "experiences"),
        ({"step": 0, "updated_at": "t", "experiences": {"G0": "x"}, "extra": 1}, "unknown"),
        ([], "JSON object"),
    ],
)
def test_parse_guidance_rejects(data: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_guidance(data)


# ------------------------------------------------------------------ operations


def test_add_update_delete_merge_bump_step_once() -> None:
    out = apply(
        {
            "operations": [
                {"op": "add", "text": "green  means\nfail", "evidence": ["g1::fail"]},
                {"op": "update", "key": "G1", "text": "red or orange means fail", "evidence": EVIDENCE},
                {"op": "delete", "key": "G2", "evidence": ["g2::pass"], "reason": "contradicted"},
            ]
        }
    )
    assert out.changed and out.rejected is None and out.dropped == []
    assert out.guidance.step == 4 and out.guidance.updated_at == NOW
    assert out.guidance.experiences == {
        "G0": "focus",
        "G1": "red or orange means fail",
        "G3": "green means fail",
        "S1": "people rule",
    }
    assert [op.op for op in out.accepted] == ["add", "update", "delete"]
    assert out.accepted[0].keys == ("G3",) and out.accepted[2].reason == "contradicted"
    assert BASE.experiences["G1"] == "red means fail"  # the input is not mutated


def test_merge_keeps_the_lowest_key() -> None:
    g = Guidance(0, "", {"G0": "f", "G2": "a", "G5": "b", "G7": "c"})
    out = apply([{"op": "merge", "keys": ["G5", "G2"], "text": "a or b", "evidence": ["g1::fail"]}], g)
    assert out.changed and out.guidance.experiences == {"G0": "f", "G2": "a or b", "G7": "c"}


@pytest.mark.parametrize(
    ("op", "why"),
    [
        ({"op": "delete", "key": "G0", "evidence": EVIDENCE}, "G0"),
        ({"op": "update", "key": "G0", "text": "new focus", "evidence": EVIDENCE}, "G0"),
        ({"op": "merge", "keys": ["G0", "G1"], "text": "x", "evidence": EVIDENCE}, "G0"),
        ({"op": "update", "key": "S1", "text": "x", "evidence": EVIDENCE}, "read-only"),
        ({"op": "delete", "key": "S1", "evidence": EVIDENCE}, "read-only"),
        ({"op": "delete", "key": "G9", "evidence": EVIDENCE}, "no rule G9"),
        ({"op": "delete", "key": "X", "evidence": EVIDENCE}, "not a learnable"),
        ({"op": "add", "text": "x", "evidence": ["other::fail"]}, "not a ticket of this reflection batch"),
        ({"op": "add", "text": "x", "evidence": ["g1::fail", "g9::pass"]}, "not a ticket"),
        ({"op": "add", "text": "x", "evidence": []}, "evidence"),
        ({"op": "add", "text": "x"}, "evidence"),
        ({"op": "add", "text": "  ", "evidence": EVIDENCE}, "text"),
        ({"op": "add", "text": "x" * 501, "evidence": EVIDENCE}, "longer"),
        # a `\ud83d` escape without its pair in the model's answer: the rule was accepted, and saving it (UTF-8)
        # ended the run, again at every resume (the same seed gives the same answer)
        ({"op": "add", "text": "red \ud83d means fail", "evidence": EVIDENCE}, "text holds a lone surrogate"),
        (
            {"op": "update", "key": "G1", "text": "\udc80", "evidence": EVIDENCE},
            "text holds a lone surrogate",
        ),
        (
            {"op": "add", "text": "x", "reason": "\ud800", "evidence": EVIDENCE},
            "reason holds a lone surrogate",
        ),
        ({"op": "add", "text": "x", "evidence": EVIDENCE, "key": "G4"}, "unknown field"),
        ({"op": "rename", "key": "G1", "evidence": EVIDENCE}, "op must be"),
        ({"op": "merge", "keys": ["G1"], "text": "x", "evidence": EVIDENCE}, "at least two"),
        ({"op": "merge", "keys": ["G1", "G1"], "text": "x", "evidence": EVIDENCE}, "distinct"),
        ("delete everything", "JSON object"),
    ],
)
def test_unsafe_or_invalid_operations_are_dropped(op: Any, why: str) -> None:
    out = apply([op])
    assert not out.changed and out.guidance is BASE and out.accepted == []
    assert len(out.dropped) == 1 and why in out.dropped[0].reason


def test_a_bad_operation_does_not_sink_the_good_ones() -> None:
    out = apply(
        [
            {"op": "delete", "key": "G0", "evidence": EVIDENCE},
            {"op": "add", "text": "foreign", "evidence": ["stranger::pass"]},
            {"op": "add", "text": "yellow means fail", "evidence": ["g1::fail"]},
        ]
    )
    assert out.changed and out.guidance.experiences["G3"] == "yellow means fail"
    reasons = [d.reason for d in out.dropped]
    assert len(reasons) == 2 and reasons[0].startswith("G0") and "not a ticket" in reasons[1]
    assert "G0" in out.guidance.experiences


def test_duplicate_add_merges_into_the_existing_rule() -> None:
    out = apply([{"op": "add", "text": "Red   MEANS fail", "evidence": ["g1::fail"]}])
    assert not out.changed and out.guidance is BASE
    assert out.merged_duplicates == [("Red MEANS fail", "G1")]
    out = apply(
        [
            {"op": "add", "text": "green means fail", "evidence": ["g1::fail"]},
            {"op": "add", "text": "green means fail", "evidence": ["g2::pass"]},
        ]
    )
    assert len(out.accepted) == 1 and out.merged_duplicates == [("green means fail", "G3")]
    assert list(out.guidance.experiences).count("G3") == 1 and "G4" not in out.guidance.experiences


def test_second_operation_on_the_same_rule_conflicts() -> None:
    out = apply(
        [
            {"op": "update", "key": "G1", "text": "a", "evidence": EVIDENCE},
            {"op": "delete", "key": "G1", "evidence": EVIDENCE},
        ]
    )
    assert out.guidance.experiences["G1"] == "a" and "conflicts" in out.dropped[0].reason


def test_at_most_max_operations() -> None:
    ops = [{"op": "add", "text": f"rule {k}", "evidence": ["g1::fail"]} for k in range(4)]
    out = apply(ops, max_operations=2)
    assert len(out.accepted) == 2 and len(out.dropped) == 2
    assert all("max_operations" in d.reason for d in out.dropped)
    assert out.guidance.step == BASE.step + 1  # one accepted change set = one step


def test_a_set_that_would_empty_the_experiences_is_rejected() -> None:
    out = apply(
        [
            {"op": "delete", "key": "G1", "evidence": EVIDENCE},
            {"op": "delete", "key": "G2", "evidence": EVIDENCE},
        ]
    )
    assert out.rejected is not None and "every learnable rule" in out.rejected
    assert not out.changed and out.guidance is BASE and out.accepted == []


@pytest.mark.parametrize("raw", [None, 3, "x", {"ops": []}, {"operations": "add"}])
def test_answers_of_the_wrong_shape_are_rejected(raw: Any) -> None:
    out = apply(raw)
    assert out.rejected is not None and not out.changed and out.guidance is BASE


def test_an_empty_list_is_a_valid_no_change() -> None:
    out = apply({"operations": []})
    assert out.rejected is None and not out.changed and out.guidance is BASE


# ------------------------------------------------------------------ store


def test_save_snapshots_first_and_prunes(tmp_path: Path) -> None:
    store = GuidanceStore(tmp_path / "run", retention=2)
    for step in range(4):
        store.save(Guidance(step, NOW, {"G0": "f", "G1": f"rule {step}"}))
    snapshots = store.snapshots()
    assert len(snapshots) == 2
    assert [json.loads(p.read_text())["step"] for p in snapshots] == [2, 3]
    assert store.load() == Guidance(3, NOW, {"G0": "f", "G1": "rule 3"})
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["guidance.json", "snapshots"]


@pytest.mark.parametrize("crash", ["replace", "fsync"])
def test_crash_mid_write_keeps_the_old_guidance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash: str
) -> None:
    store = GuidanceStore(tmp_path, retention=5)
    old = Guidance(1, NOW, {"G0": "f", "G1": "old rule"})
    store.save(old)
    before = store.path.read_bytes()

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(os, crash, boom)
    with pytest.raises(OSError, match="simulated crash"):
        store.save(Guidance(2, NOW, {"G0": "f", "G1": "new rule"}))
    monkeypatch.undo()
    assert store.path.read_bytes() == before
    assert read_guidance_file(store.path) == old
    leftovers = [p.name for p in tmp_path.rglob("*.tmp")]
    assert leftovers == []  # the temporary file is removed


def test_crash_between_snapshot_and_replace_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GuidanceStore(tmp_path, retention=5)
    store.save(Guidance(1, NOW, {"G0": "f"}))
    real_replace = os.replace

    def replace_snapshots_only(src: str, dst: str) -> None:
        if Path(dst).name == "guidance.json":
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_snapshots_only)
    with pytest.raises(OSError):
        store.save(Guidance(2, NOW, {"G0": "f", "G1": "new"}))
    monkeypatch.undo()
    assert read_guidance_file(store.path).step == 1
    assert [json.loads(p.read_text())["step"] for p in store.snapshots()] == [1, 2]


def test_read_guidance_file_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "g.json"
    bad.write_text('{"step": 0, "updated_at": "t", "experiences": {"G1": "x"}}')
    with pytest.raises(ValueError, match=r"g\.json: experiences\.G0"):
        read_guidance_file(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_guidance_file(bad)
    with pytest.raises(ValueError, match="not found"):
        read_guidance_file(tmp_path / "missing.json")


def test_a_guidance_file_with_a_lone_surrogate_or_nested_too_deeply_is_an_error_naming_it(
    tmp_path: Path,
) -> None:
    """A rule holding `\\ud83d` alone loaded and ended the run at its first prompt (the model engine's tokenizer,
    a TypeError traceback) or at the first save (`utf-8 codec can't encode`, naming no file); JSON nested too
    deeply ended the start with a RecursionError traceback."""
    bad = tmp_path / "g.json"
    bad.write_text('{"step": 0, "updated_at": "t", "experiences": {"G0": "focus \\ud83d"}}')
    with pytest.raises(ValueError, match=r"g\.json: a string holds a lone surrogate escape"):
        read_guidance_file(bad)
    bad.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"g\.json: not valid JSON \(nested too deeply\)"):
        read_guidance_file(bad)


def test_a_relative_guidance_path_not_found_names_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        read_guidance_file(Path("g/guidance.json"))
    assert str(info.value) == (
        f"guidance file not found: g/guidance.json (relative paths are read from the working directory, {tmp_path})"
    )


UPSTREAM_GUIDANCE = {
    "挡风板安装检查": {
        "step": 3,
        "updated_at": "2025-01-02T03:04:05+00:00",
        "experiences": {"G0": "判断挡风板安装是否正确", "G1": "挡风板缺失则不通过"},
        "metadata": {"G1": {"reflection_id": "r1", "sources": ["QC-1"], "rationale": None}},
    },
    "BBU安装方式检查": {"step": 0, "updated_at": "2025-01-01T00:00:00+00:00", "experiences": {"G0": "判断"}},
}


def test_upstream_multi_mission_guidance_gives_the_mission_s_section(tmp_path: Path) -> None:
    """Upstream's initial_guidance.json holds every mission's guidance keyed by mission (with per-rule
    `metadata`); it was refused as `missing key 'step'`."""
    path = tmp_path / "initial_guidance.json"
    path.write_text(json.dumps(UPSTREAM_GUIDANCE, ensure_ascii=False), encoding="utf-8")
    guidance = read_guidance_file(path, "挡风板安装检查")
    assert guidance.step == 3 and guidance.experiences == {
        "G0": "判断挡风板安装是否正确",
        "G1": "挡风板缺失则不通过",
    }
    with pytest.raises(
        ValueError, match=r"several missions \(挡风板安装检查, BBU安装方式检查\).*without mission 'qc'"
    ):
        read_guidance_file(path, "qc")
    with pytest.raises(ValueError, match="missing key 'step'"):  # without a mission, one mission's file only
        read_guidance_file(path)
    broken = {"挡风板安装检查": {**UPSTREAM_GUIDANCE["挡风板安装检查"], "metadata": []}}
    path.write_text(json.dumps(broken, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(
        ValueError, match=r"initial_guidance\.json: mission '挡风板安装检查': metadata must be an object"
    ):
        read_guidance_file(path, "挡风板安装检查")


def test_metadata_is_refused_in_a_guidance_file_of_our_own(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps({**UPSTREAM_GUIDANCE["挡风板安装检查"]}, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown key\(s\): metadata"):
        read_guidance_file(path, "挡风板安装检查")


def test_read_guidance_file_skips_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    text = json.dumps(
        {"step": 3, "updated_at": "t", "experiences": {"G0": "焦点", "G1": "红色不通过"}}, ensure_ascii=False
    )
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    guidance = read_guidance_file(path)
    assert guidance.step == 3 and guidance.experiences["G1"] == "红色不通过"


# ------------------------------------------------------------------ upstream-style files and answers


@pytest.mark.parametrize("missing", ["step", "updated_at"])
def test_guidance_file_without_step_or_updated_at_names_file_and_key(tmp_path: Path, missing: str) -> None:
    data = {
        "step": 2,
        "updated_at": "2026-11-20T00:00:00Z",
        "experiences": {"G0": "focus", "G1": "red fails"},
    }
    del data[missing]
    path = tmp_path / "upstream_guidance.json"
    path.write_text(json.dumps(data, ensure_ascii=False))
    with pytest.raises(ValueError, match=rf"upstream_guidance\.json: missing key '{missing}'"):
        read_guidance_file(path)


@pytest.mark.parametrize(
    "data",
    [
        {"step": 1, "updated_at": "t", "focus": "挑出缺陷", "experiences": {"G0": "挑出缺陷"}},
        {"step": 1, "updated_at": "t", "experiences": {"focus": "挑出缺陷", "G1": "red fails"}},
    ],
)
def test_legacy_focus_key_says_what_replaces_it(tmp_path: Path, data: dict[str, Any]) -> None:
    path = tmp_path / "legacy.json"
    path.write_text(json.dumps(data, ensure_ascii=False))
    with pytest.raises(ValueError, match=r"legacy\.json: the legacy 'focus' key .* experiences\.G0"):
        read_guidance_file(path)


@pytest.mark.parametrize(
    "op",
    [
        {"op": "add", "text": "需复核时通过。", "evidence": ["g1::fail"]},
        {"op": "update", "key": "G1", "text": "红色需要复核", "evidence": ["g1::fail"]},
        {
            "op": "merge",
            "keys": ["G1", "G2"],
            "text": "If uncertain, answer need review",
            "evidence": EVIDENCE,
        },
    ],
)
def test_rule_text_with_a_third_state_marker_is_dropped_with_the_reason(op: dict[str, Any]) -> None:
    out = apply([op])
    assert not out.changed and out.guidance is BASE
    (dropped,) = out.dropped
    assert "third-state marker" in dropped.reason
    record = ReflectionRecord(Ticket("m", "g1", "fail", (("image_1", "x"),)), "pass", 1, 0, ())
    row = reflection_row(ReflectionResult(BASE, out, json.dumps({"operations": [op]}), None), [record])
    assert row["changed"] is False and "third-state marker" in row["dropped"][0]["reason"]


def test_merge_naming_a_missing_rule_is_dropped_whole() -> None:
    # upstream would merge G1 and G2 and warn about G7; ours refuses the whole merge (docs/stage_b.md)
    out = apply([{"op": "merge", "keys": ["G1", "G2", "G7"], "text": "red or blue", "evidence": EVIDENCE}])
    assert not out.changed and out.guidance.experiences == BASE.experiences
    (dropped,) = out.dropped
    assert dropped.reason == "merge names no rule G7: the whole merge is dropped"


def test_restore_puts_back_the_boundary_guidance_and_drops_later_snapshots(tmp_path: Path) -> None:
    """A resume after a batch that was cut off mid-reflection: guidance.json goes back to the step of the
    last batch boundary, and the snapshot that batch made goes (the resumed run makes it again)."""
    store = GuidanceStore(tmp_path, retention=5)
    start = Guidance(0, "t0", {"G0": "focus"})
    store.save(start)
    store.save(Guidance(1, "t1", {"G0": "focus", "G1": "red means fail"}))
    store.restore(start)
    assert store.load() == start
    assert [p.name.endswith("-step000000.json") for p in store.snapshots()] == [True]


def test_restore_keeps_a_guidance_json_changed_by_hand_after_the_stop(tmp_path: Path) -> None:
    """A rule fixed by hand in the run's guidance.json between a stop and `--resume` was overwritten with the
    boundary guidance without a word; what a cut-off batch saved is still reverted silently."""
    store = GuidanceStore(tmp_path, retention=5)
    start = Guidance(0, "t0", {"G0": "focus", "G1": "red means fail"})
    store.save(start)
    edited = store.path.read_text().replace("red means fail", "red means pass")
    store.path.write_text(edited)

    kept = store.restore(start)
    assert kept is not None and kept.parent == tmp_path and kept.name.startswith("guidance.edited-")
    assert kept.read_text() == edited and store.load() == start

    store.save(Guidance(1, "t1", {"G0": "focus", "G1": "blue means fail"}))  # a batch then cut off
    assert store.restore(start) is None and store.load() == start
    assert store.restore(start) is None  # guidance.json already the boundary's
