"""`runner.engine: server`: the backend connects to the servers of its `ServerList`; what goes wrong is
reported under the `runner.server` keys a user wrote."""

from __future__ import annotations

import pytest

from stagectl.config import load_config
from stagectl.config.plan_stage_b import ServerBackendPlan, stage_b_plan
from stagectl.stage_b.engine_server import connect_server_backend

STAGE_B = ["mission=m", "tickets=[t.jsonl]", "guidance.path=g.json", "runner.engine=server"]


def test_a_missing_token_names_the_runner_server_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STAGECTL_TEST_NO_SUCH_TOKEN", raising=False)
    cfg = load_config(
        None,
        [
            *STAGE_B,
            "runner.server.base_urls=[http://127.0.0.1:9]",
            "runner.server.auth_token_env=STAGECTL_TEST_NO_SUCH_TOKEN",
        ],
    )
    backend = stage_b_plan(cfg).backend
    assert isinstance(backend, ServerBackendPlan)
    with pytest.raises(
        ValueError, match=r"^runner\.server\.auth_token_env names \$STAGECTL_TEST_NO_SUCH_TOKEN"
    ):
        connect_server_backend(backend.servers)


def test_servers_that_never_answer_are_reported_under_base_urls(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(
        None, [*STAGE_B, "runner.server.base_urls=[http://127.0.0.1:9]", "runner.server.wait_healthy_s=0.2"]
    )
    backend = stage_b_plan(cfg).backend
    assert isinstance(backend, ServerBackendPlan)
    with pytest.raises(ValueError, match=r"^runner\.server\.base_urls: .*not healthy"):
        connect_server_backend(backend.servers)
    # the wait is said while it lasts, not only at its end
    assert (
        "stage-b: waiting up to 0.2 s (runner.server.wait_healthy_s) for /health/ of http://127.0.0.1:9"
        in capsys.readouterr().err
    )
