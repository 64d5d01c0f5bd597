"""One reflection step (rank 0 only): ask the engine for guidance operations about a batch of queued
records, decode its strict-JSON answer, and validate/apply the operations (`guidance_ops`).

The answer must be one JSON value; a single surrounding Markdown code fence is tolerated. An answer
that does not decode changes nothing and is logged with its error.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from stagectl.config.plan_stage_b import ReflectionPlan
from stagectl.stage_b.engine import Backend, ReflectRequest
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.guidance_ops import OpsOutcome, apply_operations
from stagectl.stage_b.prompts import ReflectionRecord, reflection_messages


@dataclass(frozen=True)
class ReflectionResult:
    before: Guidance
    outcome: OpsOutcome
    answer: str
    decode_error: str | None


def decode_answer(text: str) -> tuple[Any, str | None]:
    """(decoded JSON, None) or (None, why it is not strict JSON). Never raises."""
    body = text.strip()
    if body.startswith("```") and body.endswith("```") and len(body) >= 6:
        body = body[3:-3]
        newline = body.find("\n")
        body = body[newline + 1 :] if newline >= 0 and body[:newline].strip().isalnum() else body
    try:
        return json.loads(body), None
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} at character {exc.pos}"
    except RecursionError:
        return None, "not JSON: nested too deeply"
    except ValueError as exc:  # an integer of more than 4300 digits (a model repeating a digit)
        return None, f"not JSON: {exc}"


def reflect(
    engine: Backend,
    guidance: Guidance,
    records: Sequence[ReflectionRecord],
    plan: ReflectionPlan,
    mission: str,
    seed: int,
    now: str,
) -> ReflectionResult:
    messages = reflection_messages(guidance, records, mission, plan.max_operations)
    request = ReflectRequest(guidance=guidance, records=list(records), messages=messages)
    answer = engine.reflect(request, plan.sampling, seed)
    raw, error = decode_answer(answer)
    keys = [r.ticket.key for r in records]
    if error is not None:
        return ReflectionResult(guidance, OpsOutcome(guidance, rejected=error), answer, error)
    outcome = apply_operations(raw, guidance, keys, plan.max_operations, now)
    return ReflectionResult(guidance, outcome, answer, None)


def reflection_row(result: ReflectionResult, records: Sequence[ReflectionRecord]) -> dict[str, Any]:
    """One line of reflection.jsonl."""
    outcome = result.outcome
    return {
        "records": [r.ticket.key for r in records],
        "guidance_step_before": result.before.step,
        "guidance_step_after": outcome.guidance.step,
        "changed": outcome.changed,
        "accepted": [asdict(op) for op in outcome.accepted],
        "dropped": [asdict(op) for op in outcome.dropped],
        "merged_duplicates": [{"text": t, "into": k} for t, k in outcome.merged_duplicates],
        "rejected": outcome.rejected,
        "decode_error": result.decode_error,
        "answer": result.answer,
    }
