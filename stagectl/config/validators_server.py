"""Named validators of the rollout server sections: security, access, limits, the embedded server and
the server list (see `validators` for the convention: one rule each, `Problem`s returned, never raised)."""

from __future__ import annotations

from stagectl.config.root import (
    LOOPBACK_HOSTS,
    Problem,
    StagectlConfig,
    is_train_ab,
    is_zero_ratio,
    uses_server_rollouts,
)


def validate_server_security(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    rs = cfg.rollout_server
    if rs.host not in LOOPBACK_HOSTS and not rs.auth_token_env:
        return [
            Problem(
                "rollout_server.auth_token_env",
                f"the server binds {rs.host!r} (beyond loopback), so every endpoint but /health/ needs a bearer "
                "token; set auth_token_env to the name of an environment variable holding it, or bind 127.0.0.1",
            )
        ]
    return []


def validate_server_access(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """`open_infer` beyond loopback only when confirmed; TLS files in pairs; a client verifies or says not to."""
    rs = cfg.rollout_server
    problems = []
    if rs.open_infer_beyond_loopback and not rs.open_infer:
        problems.append(
            Problem(
                "rollout_server.open_infer_beyond_loopback",
                "confirms open_infer; set open_infer: true or remove it",
            )
        )
    if rs.open_infer and rs.host not in LOOPBACK_HOSTS and not rs.open_infer_beyond_loopback:
        problems.append(
            Problem(
                "rollout_server.open_infer",
                f"the server binds {rs.host!r} (beyond loopback): an open /infer/ lets anyone who can reach it "
                "use the engine; set open_infer_beyond_loopback: true to accept that, or drop open_infer",
            )
        )
    if (rs.tls_certfile is None) != (rs.tls_keyfile is None):
        problems.append(
            Problem(
                "rollout_server.tls_certfile", "TLS needs both tls_certfile and tls_keyfile (PEM), or neither"
            )
        )
    learner = cfg.custom.extra.rollout_matching.vllm.server
    embedded_tls = rs.embedded and rs.tls_certfile is not None
    for key, client, urls, via_embedded in (
        (
            "custom.extra.rollout_matching.vllm.server",
            learner,
            # an embedded server fills the list at launch (http:// unless rollout_server.tls_certfile)
            [s.base_url for s in learner.servers] or (["http://127.0.0.1"] if rs.embedded else []),
            embedded_tls,
        ),
        ("runner.server", cfg.runner.server, cfg.runner.server.base_urls, False),
    ):
        if client.tls_skip_verify and client.tls_ca_file is not None:
            problems.append(
                Problem(f"{key}.tls_skip_verify", "excludes tls_ca_file: verify against the CA file, or skip")
            )
        https = via_embedded or any(url.startswith("https://") for url in urls)
        if urls and not https and (client.tls_ca_file is not None or client.tls_skip_verify):
            problems.append(
                Problem(
                    f"{key}.tls_ca_file" if client.tls_ca_file is not None else f"{key}.tls_skip_verify",
                    "applies to https:// servers only and every server here is http://; use https:// URLs "
                    "(servers with rollout_server.tls_certfile) or remove it",
                )
            )
    if embedded_tls and learner.tls_ca_file is None and not learner.tls_skip_verify:
        problems.append(
            Problem(
                "custom.extra.rollout_matching.vllm.server.tls_ca_file",
                "the embedded server serves https:// (rollout_server.tls_certfile) at 127.0.0.1: set this to "
                "a CA file that signed its certificate (the certificate itself if self-signed; it must name "
                "IP 127.0.0.1), or drop TLS for the loopback-only embedded server",
            )
        )
    return problems


def validate_server_limits(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    """Explicit per-call bounds below what the same config's learner asks for would fail its rollouts."""
    rs = cfg.rollout_server
    if not is_train_ab(cfg) or not uses_server_rollouts(cfg):
        return []
    rm = cfg.custom.extra.rollout_matching
    problems = []
    if rs.max_new_tokens_cap is not None and rs.max_new_tokens_cap < rm.max_new_tokens:
        problems.append(
            Problem(
                "rollout_server.max_new_tokens_cap",
                f"{rs.max_new_tokens_cap} is below custom.extra.rollout_matching.max_new_tokens "
                f"({rm.max_new_tokens}): raise it or leave it null",
            )
        )
    cb = cfg.stage2_ab.channel_b if cfg.stage2_ab else None
    decode_bs = (cb.rollout_decode_batch_size if cb else None) or rm.decode_batch_size
    if rs.max_requests_per_call is not None and rs.max_requests_per_call < decode_bs:
        problems.append(
            Problem(
                "rollout_server.max_requests_per_call",
                f"{rs.max_requests_per_call} is below the rollout decode batch size ({decode_bs}), the "
                "size of the learner's calls: raise it or leave it null",
            )
        )
    return problems


def validate_embedded_server(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if not cfg.rollout_server.embedded:
        return []
    problems = []
    if not uses_server_rollouts(cfg):
        problems.append(
            Problem(
                "rollout_server.embedded",
                "an embedded server feeds server-mode rollouts; set custom.extra.rollout_matching."
                "rollout_backend: vllm (vllm.mode: server) or embedded: false",
            )
        )
    if cfg.custom.extra.rollout_matching.vllm.server.servers:
        problems.append(
            Problem(
                "custom.extra.rollout_matching.vllm.server.servers",
                "rollout_server.embedded: true starts its own server on a free loopback port; "
                "remove servers or set embedded: false",
            )
        )
    client = cfg.custom.extra.rollout_matching.vllm.server
    if cfg.rollout_server.auth_token_env and not client.auth_token_env:
        problems.append(
            Problem(
                "custom.extra.rollout_matching.vllm.server.auth_token_env",
                "the embedded server requires a bearer token (rollout_server.auth_token_env) on every "
                "endpoint but /health/; set this to the same variable so the learner sends it",
            )
        )
    return problems


def validate_server_list(cfg: StagectlConfig, world_size: int) -> list[Problem]:
    if not is_train_ab(cfg) or not uses_server_rollouts(cfg) or cfg.rollout_server.embedded:
        return []
    if cfg.custom.extra.rollout_matching.vllm.server.servers:
        return []
    ratio = cfg.stage2_ab.schedule.b_ratio if cfg.stage2_ab is not None else None
    if ratio is not None and is_zero_ratio(ratio):
        return []  # an A-only run (the baseline of an AB config) never calls a rollout server
    return [
        Problem(
            "custom.extra.rollout_matching.vllm.server.servers",
            "server-mode rollouts need at least one server: add `- base_url: http://127.0.0.1:8000` "
            "or set rollout_server.embedded: true",
        )
    ]
