"""The rollout server's request guards, written once for both ports: the bearer-token comparison and the
bounds on the work one `/infer/` call may ask for. Pure: the HTTP layers (`rollout.app`, `weightsync.stream`)
and the engines call these and map the distinct failures onto distinct status codes."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

DEFAULT_MAX_NEW_TOKENS_CAP = 8192  # well above any detection rollout or Stage-B answer we have seen
DEFAULT_MAX_REQUESTS_PER_CALL = 1024  # a learner call holds one decode chunk (8 by default)


class TooManyRequests(ValueError):
    """More requests in one `/infer/` call than `max_requests_per_call` (HTTP 413)."""


class TooManyTokens(ValueError):
    """`max_tokens` above the server's cap, or prompt + `max_tokens` beyond the engine's context (HTTP 400)."""


def bearer_ok(authorization: str | None, expected: str) -> bool:
    """Whether an `Authorization` header value is `Bearer <expected>` (constant-time comparison)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected.encode())


@dataclass(frozen=True)
class CallLimits:
    max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP  # most `max_tokens` one call may ask for
    max_requests_per_call: int = DEFAULT_MAX_REQUESTS_PER_CALL  # most requests in one call


def check_call(num_requests: int, max_tokens: int, limits: CallLimits, max_model_len: int) -> None:
    """Refuse a call before any of its work starts: too many requests (`TooManyRequests`), `max_tokens`
    above the cap or leaving no room for a prompt in the engine's context (`TooManyTokens`)."""
    if num_requests > limits.max_requests_per_call:
        raise TooManyRequests(
            f"{num_requests} requests in one call; this server takes at most {limits.max_requests_per_call} "
            "(rollout_server.max_requests_per_call): split the call"
        )
    if max_tokens > limits.max_new_tokens_cap:
        raise TooManyTokens(
            f"request_config.max_tokens {max_tokens} exceeds this server's cap of {limits.max_new_tokens_cap} "
            "(rollout_server.max_new_tokens_cap)"
        )
    if max_tokens >= max_model_len:
        raise TooManyTokens(
            f"request_config.max_tokens {max_tokens} leaves no room for a prompt in the engine's "
            f"max_model_len of {max_model_len} tokens"
        )


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """`TooManyTokens` unless prompt + `max_tokens` fits the engine's context (called once the prompt is
    encoded, so the count is the engine's own)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise TooManyTokens(
            f"a prompt of {num_prompt_tokens} tokens + request_config.max_tokens {max_tokens} = "
            f"{num_prompt_tokens + max_tokens} exceeds the engine's max_model_len of {max_model_len} tokens"
        )
