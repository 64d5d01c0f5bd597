"""`BStepLedger`: B steps wanted vs trained with the reason of every wanted B step that trained as A, as
plain data (checkpoints, final_state.json), as the summary line, and the off-schedule warning."""

from __future__ import annotations

import pytest

from stagectl.learner.channel_b.protocol import BStepLedger


def _ledger() -> BStepLedger:
    ledger = BStepLedger()
    for wants_b, kind, reason in [
        (False, "A", None),
        (True, "B", None),
        (True, "A", "queue_empty"),
        (False, "A", None),
        (True, "A", "no_server"),
        (True, "A", "no_server"),
        (True, "A", "stale_packs"),
        (True, "B", None),
    ]:
        ledger.record(wants_b, kind, reason)  # type: ignore[arg-type]
    return ledger


def test_counts_reasons_and_round_trips() -> None:
    ledger = _ledger()
    saved = ledger.as_dict()
    assert saved == {
        "num_steps": 8,
        "b_steps_wanted": 6,
        "b_steps_trained": 2,
        "b_steps_as_a": {"queue_empty": 1, "no_server": 2, "stale_packs": 1},
    }
    assert BStepLedger.from_dict(saved) == ledger
    assert ledger.summary_line() == (
        "B steps: 6 wanted, 2 trained; 4 as Channel-A (queue_empty 1, no_server 2, stale_packs 1)"
    )


def test_a_wanted_b_step_as_a_needs_its_reason() -> None:
    with pytest.raises(AssertionError, match="reason"):
        BStepLedger().record(True, "A", None)


def test_unknown_reason_in_a_checkpoint_is_named() -> None:
    saved = {**_ledger().as_dict(), "b_steps_as_a": {"late": 1}}
    with pytest.raises(ValueError, match="unknown reason 'late'"):
        BStepLedger.from_dict(saved)


@pytest.mark.parametrize(("tolerance", "warns"), [(0.5, False), (0.4, True), (0.0, True)])
def test_off_schedule_warning(tolerance: float, warns: bool) -> None:
    warning = _ledger().off_schedule(tolerance)  # wanted 6/8 = 0.75, trained 2/8 = 0.25
    assert (warning is not None) == warns
    if warning is not None:
        assert "realized b_ratio 0.25" in warning and "schedule's 0.75" in warning


def test_on_schedule_run_has_no_warning() -> None:
    ledger = BStepLedger()
    for step in range(4):
        ledger.record(step % 2 == 1, "B" if step % 2 else "A", None)
    assert ledger.off_schedule(0.0) is None and ledger.summary_line() == "B steps: 2 wanted, 2 trained"
