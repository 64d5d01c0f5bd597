"""Stage-B prompts, the rules engine, reflection decoding, metrics."""

from __future__ import annotations

import json

import pytest

from stagectl.config.plan_stage_b import ReflectionPlan
from stagectl.config.sampling import SamplingSpec
from stagectl.stage_b.engine import JudgeRequest, candidate_seed
from stagectl.stage_b.engine_rules import RulesBackend
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.metrics import MetricsWindow
from stagectl.stage_b.prompts import ReflectionRecord, reflection_messages, rollout_messages
from stagectl.stage_b.reflection import decode_answer, reflect
from stagectl.stage_b.selection import select_verdict
from stagectl.stage_b.tickets import Ticket
from stagectl.stage_b.verdict import THIRD_STATE_MARKERS, parse_verdict

G = Guidance(0, "", {"G0": "judge the group", "G1": "red means fail"})
RED = Ticket("m", "g1", "fail", (("image_1", "red circle"), ("image_2", "blue square")))
BLUE = Ticket("m", "g2", "pass", (("image_1", "blue circle"),))
GREEN_FAIL = Ticket("m", "g3", "fail", (("image_1", "green circle"), ("image_2", "blue dot")))
SPEC = SamplingSpec(max_new_tokens=16, temperature=0.7, top_p=0.9)


def judge(
    engine: RulesBackend, ticket: Ticket, guidance: Guidance = G, batch_index: int = 0, seed: int = 4
) -> str:
    request = JudgeRequest(ticket, guidance, rollout_messages(guidance, ticket, "m"), batch_index)
    return engine.judge([request], SPEC, seed)[0]


def test_rollout_prompt_shows_guidance_and_summaries_never_the_label() -> None:
    messages = rollout_messages(G, RED, "m")
    user = messages[-1]["content"]
    assert "[G1] red means fail" in user and "image_2: blue square" in user
    assert "g1::fail" not in user and "label" not in user.lower()
    assert "Verdict: pass" in messages[0]["content"]  # the contract is stated


def test_reflection_prompt_lists_records_with_keys_and_labels() -> None:
    record = ReflectionRecord(RED, "pass", 2, 0, ("looks fine",))
    user = reflection_messages(G, [record], "m", 2)[-1]["content"]
    entry = json.loads(user.splitlines()[-1])
    assert entry["ticket"] == "g1::fail" and entry["label"] == "fail" and entry["model_verdict"] == "pass"


def test_rules_engine_answers_from_the_guidance_it_is_given() -> None:
    engine = RulesBackend()
    assert parse_verdict(judge(engine, RED)).verdict == "fail"
    assert parse_verdict(judge(engine, BLUE)).verdict == "pass"
    no_rules = Guidance(0, "", {"G0": "judge"})
    assert parse_verdict(judge(engine, RED, no_rules)).verdict == "pass"


def test_rules_engine_third_state_and_ambiguous_answers() -> None:
    engine = RulesBackend()
    unreadable = Ticket("m", "u", "pass", (("image_1", "unreadable blur"),))
    assert parse_verdict(judge(engine, unreadable)).error is not None
    ambiguous = Ticket("m", "a", "pass", (("image_1", "ambiguous shape"),))
    verdicts = {parse_verdict(judge(engine, ambiguous, seed=s)).verdict for s in (2, 3)}
    assert verdicts == {"pass", "fail"}


def test_reflect_with_the_rules_engine_adds_a_rule_and_drops_the_unsafe_op() -> None:
    records = [
        ReflectionRecord(GREEN_FAIL, "pass", 1, 0, ()),
        ReflectionRecord(BLUE, "fail", 0, 1, ()),
    ]
    plan = ReflectionPlan(
        batch_size=2, max_operations=3, sampling=SamplingSpec(max_new_tokens=256, temperature=0.0)
    )
    result = reflect(RulesBackend(), G, records, plan, "m", 0, "now")
    out = result.outcome
    assert result.decode_error is None and out.changed
    assert out.guidance.experiences["G2"] == "green means fail" and out.guidance.step == 1
    assert out.accepted[0].evidence == ("g3::fail",)
    assert [d.reason for d in out.dropped] == ["G0 (the mission focus) is protected"]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"operations": []}', True),
        ('```json\n{"operations": []}\n```', True),
        ("```\n[]\n```", True),
        ('Sure! {"operations": []}', False),
        ("", False),
        ("[" * 100000, False),
        (
            '{"operations": [' + "1" * 5000 + "]}",
            False,
        ),  # a model repeating a digit: a ValueError ended the run
    ],
)
def test_decode_answer_is_strict_json(text: str, ok: bool) -> None:
    raw, error = decode_answer(text)
    assert (error is None) is ok
    if ok:
        assert raw in ({"operations": []}, [])


def test_candidate_seed_is_stable_and_distinct() -> None:
    assert candidate_seed(0, 1, 0, 0, 5) == candidate_seed(0, 1, 0, 0, 5)
    seeds = {candidate_seed(0, e, s, 0, b) for e in range(3) for s in range(3) for b in range(3)}
    assert len(seeds) == 27


def test_metrics_window_rates() -> None:
    window = MetricsWindow()
    window.add(select_verdict(["pass"], "fail"))  # false pass
    window.add(select_verdict(["fail"], "fail"))
    window.add(select_verdict(["fail"], "pass"))  # false fail
    window.add(select_verdict(["pass", None], "pass"))
    window.add(select_verdict([None], "pass"))  # no verdict
    row = window.row(elapsed_s=2.0)
    assert row["num_tickets"] == 5 and row["accuracy"] == pytest.approx(2 / 5)
    assert row["fp_rate"] == pytest.approx(1 / 2) and row["fn_rate"] == pytest.approx(1 / 3)
    assert row["num_no_verdict"] == 1 and row["malformed_rate"] == pytest.approx(2 / 6)
    assert row["tickets_per_s"] == pytest.approx(2.5)


def test_stage_a_review_markers_do_not_reach_the_prompts() -> None:
    # a Stage-A summary as upstream writes it: a review note in front of the remark
    ticket = Ticket("m", "g4", "fail", (("image_1", "需复核,备注: 螺丝缺失"), ("image_2", "划痕; 需复核"),
                                        ("image_3", "人工复核：标签模糊")))  # fmt: skip
    rollout = rollout_messages(G, ticket, "m")[-1]["content"]
    assert "image_1: 备注: 螺丝缺失" in rollout and "image_3: 标签模糊" in rollout
    record = ReflectionRecord(ticket, "pass", 1, 1, ())
    reflection = reflection_messages(G, [record], "m", 2)[-1]["content"]
    assert json.loads(reflection.splitlines()[-1])["summaries"]["image_1"] == "备注: 螺丝缺失"
    for text in (rollout, reflection):
        assert not [m for m in THIRD_STATE_MARKERS if m in text.casefold()]


def test_a_ticket_whose_prompt_does_not_fit_the_model_is_named() -> None:
    """The model engine's context check named a prompt's length, not its ticket: a run ended mid-way on
    `a prompt of 6210 tokens ... exceeds the engine's max_model_len`, and nothing said which ticket to shorten."""
    from stagectl.engines.fake import FakeEngine
    from stagectl.stage_b.engine import ReflectRequest
    from stagectl.stage_b.engine_model import ModelBackend

    long_one = Ticket("m", "g9", "pass", (("image_1", "red circle " * 300),))
    tickets = [RED, long_one, BLUE]
    requests = [JudgeRequest(t, G, rollout_messages(G, t, "m"), 0) for t in tickets]
    backend = ModelBackend(FakeEngine(batch_wait_ms=0, max_model_len=2000))  # prompt bytes count as tokens
    try:
        with pytest.raises(
            ValueError,
            match=r"^ticket g9::pass: its rollout prompt .* does not fit the model: a "
            r"prompt of \d+ tokens .* Shorten its summaries",
        ):
            backend.judge(requests, SPEC, seed=0)
        assert len(backend.judge([requests[0], requests[2]], SPEC, seed=0)) == 2
        records = [ReflectionRecord(t, "fail", 0, 1, ("why",)) for t in tickets]
        request = ReflectRequest(G, records, reflection_messages(G, records, "m", 3))
        with pytest.raises(
            ValueError, match=r"^the reflection prompt over tickets g1::fail, g9::pass, g2::pass "
        ):
            backend.reflect(request, SPEC, seed=0)
    finally:
        backend.close()
