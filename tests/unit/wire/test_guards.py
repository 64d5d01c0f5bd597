"""The rollout server's guards as pure functions (token comparison, per-call bounds), the bounds derived from
the config a server is started with, and the config rules for `open_infer`, TLS and explicit bounds."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from stagectl.config import ConfigError, load_config
from stagectl.server.serving import server_settings
from stagectl.wire.guards import (
    DEFAULT_MAX_NEW_TOKENS_CAP,
    DEFAULT_MAX_REQUESTS_PER_CALL,
    BodyBudget,
    BodyTimeout,
    BodyTooLarge,
    CallLimits,
    TooManyRequests,
    TooManyTokens,
    Unauthorized,
    bearer_ok,
    check_call,
    check_context,
    check_token,
    validation_detail,
)
from stagectl.wire.tls import client_context, server_context

SERVER_ROLLOUTS = [
    "data.synthetic.num_samples=8",
    "stage2_ab.schedule.b_ratio=0.5",
    "custom.extra.rollout_matching.rollout_backend=vllm",
    "rollout_server.embedded=true",
]


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer tok", True),
        ("bearer tok", True),
        ("Bearer  tok ", True),
        ("Bearer tok2", False),
        ("Bearer to", False),
        ("Basic tok", False),
        ("tok", False),
        ("", False),
        (None, False),
    ],
)
def test_bearer_ok(header: str | None, ok: bool) -> None:
    assert bearer_ok(header, "tok") is ok


def test_check_call_refuses_each_bound_with_its_own_type() -> None:
    limits = CallLimits(max_new_tokens_cap=100, max_requests_per_call=4)
    check_call(4, 100, limits, max_model_len=4096)  # at every bound: fine
    with pytest.raises(TooManyRequests, match="5 requests in one call; this server takes at most 4"):
        check_call(5, 10, limits, max_model_len=4096)
    with pytest.raises(TooManyTokens, match="max_tokens 101 exceeds this server's cap of 100"):
        check_call(1, 101, limits, max_model_len=4096)
    with pytest.raises(TooManyTokens, match=r"max_tokens 100 leaves no room .* max_model_len of 100"):
        check_call(1, 100, limits, max_model_len=100)
    assert not issubclass(TooManyRequests, TooManyTokens) and not issubclass(TooManyTokens, TooManyRequests)


def test_check_context_names_both_numbers() -> None:
    check_context(96, 32, 128)
    with pytest.raises(TooManyTokens, match=r"a prompt of 97 tokens \+ .*max_tokens 32 = 129 exceeds .* 128"):
        check_context(97, 32, 128)


def test_settings_take_explicit_limits_else_the_defaults() -> None:
    """`server_settings` alone (no plan): the configured bounds, else the defaults. What a config's own
    caller raises them to is `config.plan_server.call_limits` (tests/unit/config/test_plan_server.py)."""
    assert server_settings(load_config(None, []).rollout_server).limits == CallLimits(
        DEFAULT_MAX_NEW_TOKENS_CAP, DEFAULT_MAX_REQUESTS_PER_CALL
    )
    explicit = ["rollout_server.max_new_tokens_cap=512", "rollout_server.max_requests_per_call=16"]
    assert server_settings(load_config(None, explicit).rollout_server).limits == CallLimits(512, 16)


def _problems(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return {p.path: p.message for p in info.value.problems}


def test_open_infer_beyond_loopback_needs_a_second_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    beyond = [
        "rollout_server.host=0.0.0.0",
        "rollout_server.auth_token_env=TOK",
        "rollout_server.open_infer=true",
    ]
    assert "open_infer_beyond_loopback: true" in _problems(*beyond)["rollout_server.open_infer"]
    cfg = load_config(None, [*beyond, "rollout_server.open_infer_beyond_loopback=true"])
    monkeypatch.setenv("TOK", "secret")
    settings = server_settings(cfg.rollout_server)
    assert settings.open_infer and settings.auth_token == "secret"
    assert (
        "confirms open_infer"
        in _problems("rollout_server.open_infer_beyond_loopback=true")[
            "rollout_server.open_infer_beyond_loopback"
        ]
    )
    # the runtime check (a config built without the loader's validators) refuses it too
    unchecked = cfg.rollout_server.model_copy(update={"open_infer_beyond_loopback": False})
    with pytest.raises(ValueError, match=r"rollout_server\.open_infer: the server binds .0\.0\.0\.0."):
        server_settings(unchecked)


def test_tls_keys_come_in_pairs_and_clients_verify_or_say_not_to() -> None:
    assert (
        "both tls_certfile and tls_keyfile"
        in _problems("rollout_server.tls_certfile=/c.pem")["rollout_server.tls_certfile"]
    )
    both = ["runner.server.tls_ca_file=/ca.pem", "runner.server.tls_skip_verify=true"]
    assert "excludes tls_ca_file" in _problems(*both)["runner.server.tls_skip_verify"]
    key = "custom.extra.rollout_matching.vllm.server"
    assert f"{key}.tls_skip_verify" in _problems(f"{key}.tls_ca_file=/ca.pem", f"{key}.tls_skip_verify=true")
    plain = ["runner.server.base_urls=[http://10.0.0.1:8000]", "runner.server.tls_ca_file=/ca.pem"]
    assert "https:// servers only" in _problems(*plain)["runner.server.tls_ca_file"]
    load_config(
        None, ["runner.server.base_urls=[https://10.0.0.1:8000]", "runner.server.tls_ca_file=/ca.pem"]
    )
    embedded_tls = [
        *SERVER_ROLLOUTS,
        "rollout_server.tls_certfile=/c.pem",
        "rollout_server.tls_keyfile=/k.pem",
    ]
    assert "127.0.0.1" in _problems(*embedded_tls)[f"{key}.tls_ca_file"]
    load_config(None, [*embedded_tls, f"{key}.tls_ca_file=/c.pem"])


def test_a_server_config_that_would_refuse_its_own_learner_is_refused() -> None:
    probs = _problems(
        *SERVER_ROLLOUTS,
        "custom.extra.rollout_matching.max_new_tokens=512",
        "rollout_server.max_new_tokens_cap=256",
        "stage2_ab.channel_b.rollout_decode_batch_size=8",
        "rollout_server.max_requests_per_call=4",
    )
    assert (
        "below custom.extra.rollout_matching.max_new_tokens (512)"
        in probs["rollout_server.max_new_tokens_cap"]
    )
    assert "below the rollout decode batch size (8)" in probs["rollout_server.max_requests_per_call"]


def test_an_embedded_server_with_a_token_needs_the_learner_to_send_it() -> None:
    key = "custom.extra.rollout_matching.vllm.server.auth_token_env"
    assert "same variable" in _problems(*SERVER_ROLLOUTS, "rollout_server.auth_token_env=TOK")[key]
    load_config(None, [*SERVER_ROLLOUTS, "rollout_server.auth_token_env=TOK", f"{key}=TOK"])


def test_tls_files_that_do_not_load_are_named(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("not a certificate")
    with pytest.raises(
        ValueError, match=r"tls_certfile / tls_keyfile: cannot load .*cert\.pem with .*key\.pem"
    ):
        server_context(tmp_path / "cert.pem", tmp_path / "key.pem")
    with pytest.raises(ValueError, match=r"tls_ca_file: cannot load .*missing\.pem"):
        client_context(tmp_path / "missing.pem")
    assert client_context(skip_verify=True).verify_mode == ssl.CERT_NONE


def test_check_token_refuses_a_missing_or_wrong_token_and_passes_without_one() -> None:
    check_token(None, None)  # a server without a token: open
    check_token("Bearer s3cret", "s3cret")
    for header in (None, "Bearer wrong", "Basic s3cret", "s3cret"):
        with pytest.raises(Unauthorized, match="missing or wrong bearer token"):
            check_token(header, "s3cret")


def test_body_budget_limits_declared_and_counted_bytes_and_keeps_its_deadline() -> None:
    budget = BodyBudget(limit=100, timeout_s=60.0)
    budget.declared(100)
    budget.received(100)
    with pytest.raises(BodyTooLarge, match="request body of 101 bytes exceeds 100"):
        budget.declared(101)
    with pytest.raises(BodyTooLarge, match="request body exceeds 100 bytes"):
        budget.received(101)
    assert 59.0 < budget.remaining_s() <= 60.0
    with pytest.raises(BodyTimeout, match=r"request body not received within 0\.5 s"):
        _expired(0.5)


def _expired(timeout_s: float) -> float:
    budget = BodyBudget(limit=1, timeout_s=timeout_s)
    budget.deadline -= timeout_s + 1  # the request started long ago
    return budget.remaining_s()


def test_validation_detail_names_the_field_without_the_query_or_body_prefix() -> None:
    detail, listed = validation_detail(
        [{"loc": ("query", "sync_id"), "msg": "Field required"}, {"loc": ("body",), "msg": "bad JSON"}]
    )
    assert detail == "sync_id: Field required; <body>: bad JSON"
    assert listed == [
        {"field": "sync_id", "message": "Field required"},
        {"field": "<body>", "message": "bad JSON"},
    ]


def test_a_body_that_is_not_json_says_where_it_breaks_or_which_header_to_send() -> None:
    """FastAPI reports broken JSON at `("body", <character offset>)` (read as a field named "19"), and a body
    sent without a JSON Content-Type as "Input should be a valid dictionary" (it never parsed it)."""
    broken = {
        "type": "json_invalid",
        "loc": ("body", 19),
        "msg": "JSON decode error",
        "ctx": {"error": "Expecting value"},
    }
    assert validation_detail([broken], "application/json")[0] == (
        "<body>: invalid JSON at character 19: Expecting value"
    )
    unparsed = {
        "type": "model_attributes_type",
        "loc": ("body",),
        "msg": "Input should be a valid dictionary",
    }
    assert validation_detail([unparsed], "application/x-www-form-urlencoded")[0] == (
        "<body>: send the body as JSON with Content-Type: application/json "
        "(Content-Type 'application/x-www-form-urlencoded')"
    )
    assert "(no Content-Type)" in validation_detail([unparsed], "")[0]
    for json_type in ("application/json; charset=utf-8", "application/vnd.api+json"):  # parsed: its own error
        assert validation_detail([unparsed], json_type)[0] == "<body>: Input should be a valid dictionary"
