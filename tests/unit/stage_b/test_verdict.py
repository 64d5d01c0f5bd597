"""Stage-B output contract and vote selection."""

from __future__ import annotations

import pytest

from stagectl.stage_b.selection import needs_reflection, review_reason, select_verdict
from stagectl.stage_b.verdict import parse_verdict


@pytest.mark.parametrize(
    ("text", "verdict", "reason"),
    [
        ("Verdict: pass\nReason: all images fine", "pass", "all images fine"),
        ("Verdict: fail\nReason: red shape in image_2", "fail", "red shape in image_2"),
        ("verdict: PASS\nreason: ok", "pass", "ok"),
        ("Verdict: 通过\nReason: 一切正常", "pass", "一切正常"),
        ("Verdict：不通过\nReason：有红色", "fail", "有红色"),
        ("\n  Verdict:  fail  \n\nReason:   spaced out   \n\n", "fail", "spaced out"),
        ("Verdict: pass\r\nReason: windows line ends\r\n", "pass", "windows line ends"),
    ],
)
def test_accepts_two_line_verdicts(text: str, verdict: str, reason: str) -> None:
    parsed = parse_verdict(text)
    assert parsed.ok and parsed.error is None
    assert parsed.verdict == verdict and parsed.reason == reason


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "2 non-empty lines"),
        ("Verdict: pass", "2 non-empty lines"),
        ("Verdict: pass\nReason: ok\nExtra: line", "2 non-empty lines"),
        ("Reason: ok\nVerdict: pass", "first line"),
        ("Verdict: pass\nBecause: ok", "second line"),
        ("Verdict: maybe\nReason: hmm", "verdict must be"),
        ("Verdict: pass.\nReason: trailing dot", "verdict must be"),
        ("Verdict: pass or fail\nReason: both", "verdict must be"),
        ("Verdict: pass\nReason:   ", "reason is empty"),
        ("Verdict: need review\nReason: unclear", "third-state"),
        ("Verdict: fail\nReason: needs review by a person", "third-state"),
        ("Verdict: 需复核\nReason: 看不清", "third-state"),
        ("Verdict: 通过\nReason: 不确定", "third-state"),
        ("Verdict: pass\nReason: uncertain but ok", "third-state"),
        ("**Verdict:** pass\nReason: markdown", "first line"),
    ],
)
def test_rejects_everything_else(text: str, why: str) -> None:
    parsed = parse_verdict(text)
    assert not parsed.ok and parsed.verdict is None
    assert parsed.error is not None and why in parsed.error


def test_non_text_is_a_format_error() -> None:
    assert parse_verdict(None).error == "not text (NoneType)"
    assert parse_verdict(b"Verdict: pass\nReason: x").verdict is None


def test_majority_vote_and_strength() -> None:
    sel = select_verdict(["pass", "pass", "fail", None], "pass")
    assert sel.verdict == "pass" and sel.vote_strength == pytest.approx(2 / 3)
    assert (sel.num_pass, sel.num_fail, sel.num_malformed) == (2, 1, 1)
    assert sel.label_match and sel.candidates_disagree and needs_reflection(sel)


def test_ties_go_to_fail() -> None:
    sel = select_verdict(["pass", "fail"], "pass")
    assert sel.verdict == "fail" and sel.vote_strength == 0.5 and not sel.label_match
    sel = select_verdict(["fail", "pass", "pass", "fail", None], "fail")
    assert sel.verdict == "fail" and sel.label_match


def test_unanimous_correct_ticket_is_not_queued() -> None:
    sel = select_verdict(["fail", "fail", "fail"], "fail")
    assert sel.verdict == "fail" and sel.vote_strength == 1.0
    assert not needs_reflection(sel) and review_reason(sel, 0.6) is None


def test_unanimous_wrong_ticket_is_queued() -> None:
    sel = select_verdict(["pass", "pass"], "fail")
    assert not sel.label_match and not sel.candidates_disagree and needs_reflection(sel)


def test_no_well_formed_candidate_has_no_verdict() -> None:
    sel = select_verdict([None, None], "pass")
    assert sel.verdict is None and sel.vote_strength == 0.0 and not sel.label_match
    assert not needs_reflection(sel)
    assert review_reason(sel, 0.0) == "no well-formed candidate"


def test_weak_votes_go_to_review() -> None:
    sel = select_verdict(["pass", "pass", "fail"], "pass")
    assert review_reason(sel, 0.5) is None
    reason = review_reason(sel, 0.8)
    assert reason is not None and "vote strength 0.67" in reason
