"""Property tests: parse_verdict and the guidance-operation validator never raise, whatever they get.

Examples per property: 300 under `STAGECTL_FUZZ_PROFILE=full`, a tenth (at least 20) by default
(`tests.helpers.fuzz_examples`); `STAGECTL_FUZZ_EXAMPLES=5000` for a longer run.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagectl.stage_b.guidance import FOCUS_KEY, Guidance, is_learnable, parse_guidance
from stagectl.stage_b.guidance_ops import apply_operations
from stagectl.stage_b.reflection import decode_answer
from stagectl.stage_b.verdict import parse_verdict
from tests.helpers import fuzz_examples

SETTINGS = settings(
    max_examples=fuzz_examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
BASE = Guidance(1, "", {"G0": "focus", "G1": "red means fail", "G2": "blue ok", "S1": "fixed"})
EVIDENCE = ["a::pass", "b::fail"]

WORDS = st.sampled_from(
    [
        "Verdict",
        "verdict",
        "Reason",
        ":",
        "：",
        "pass",
        "fail",
        "通过",
        "不通过",
        "need review",
        "复核",
        " ",
        "\n",
        "\r\n",
    ]
)
VERDICTISH = st.lists(st.one_of(WORDS, st.text(max_size=8)), max_size=12).map("".join)
KEYS = st.sampled_from(["G0", "G1", "G2", "G3", "G99", "S1", "Sx", "X", "", "g1"])
EVIDENCE_ITEMS = st.one_of(st.sampled_from([*EVIDENCE, "c::pass"]), st.text(max_size=6), st.integers())
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=10)
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
OP = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(["add", "update", "delete", "merge"]), ANY_JSON)},
    optional={
        "key": st.one_of(KEYS, ANY_JSON),
        "keys": st.one_of(st.lists(KEYS, max_size=4), ANY_JSON),
        "text": st.one_of(st.text(max_size=30), ANY_JSON),
        "evidence": st.one_of(st.lists(EVIDENCE_ITEMS, max_size=3), ANY_JSON),
        "reason": st.one_of(st.text(max_size=10), ANY_JSON),
        "extra": ANY_JSON,
    },
)
OPS = st.one_of(
    st.fixed_dictionaries({"operations": st.lists(st.one_of(OP, ANY_JSON), max_size=6)}),
    st.lists(st.one_of(OP, ANY_JSON), max_size=6),
    ANY_JSON,
)


@SETTINGS
@given(st.one_of(st.text(), VERDICTISH, st.binary(), st.none(), st.integers()))
def test_parse_verdict_never_raises(text: Any) -> None:
    parsed = parse_verdict(text)
    assert (parsed.verdict is None) == (parsed.error is not None)
    if parsed.ok:
        assert parsed.verdict in ("pass", "fail") and parsed.reason and "\n" not in parsed.reason


@SETTINGS
@given(OPS, st.integers(min_value=1, max_value=4))
def test_apply_operations_never_raises_and_keeps_invariants(raw: Any, max_operations: int) -> None:
    out = apply_operations(raw, BASE, EVIDENCE, max_operations, "now")
    g = out.guidance
    assert g.experiences[FOCUS_KEY] == "focus"  # G0 untouched
    assert g.experiences["S1"] == "fixed"  # S* untouched
    assert any(is_learnable(k) for k in g.experiences)  # never wiped
    assert len(out.accepted) <= max_operations
    assert g.step == BASE.step + (1 if out.changed else 0)
    for op in out.accepted:
        assert op.evidence and set(op.evidence) <= set(EVIDENCE)
    assert parse_guidance(g.to_json()) == g  # the result is always a valid guidance file


@SETTINGS
@given(
    st.one_of(
        st.text(),
        st.lists(st.sampled_from(["{", "}", "[", "]", '"operations"', ":", ",", "```"])).map("".join),
    )
)
def test_decode_answer_never_raises(text: str) -> None:
    raw, error = decode_answer(text)
    assert error is None or raw is None
    apply_operations(raw, BASE, EVIDENCE, 3, "now")
