"""The rollout server's request guards, written once for both ports (the app's and the weight-stream
port): the bearer token (`check_token`, 401), a body's size limit and deadline (`BodyBudget`: 413, 408),
the 422 detail of a query or body that fails its model (`validation_detail`), and the bounds on the work
one `/infer/` call may ask for. Pure: the HTTP layers (`server.app`, `weightsync.stream`) and the engines
call these and map each failure type onto its own status code."""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stagectl.config.rollout import DEFAULT_MAX_NEW_TOKENS_CAP, DEFAULT_MAX_REQUESTS_PER_CALL


class TooManyRequests(ValueError):
    """More requests in one `/infer/` call than `max_requests_per_call` (HTTP 413)."""


class TooManyTokens(ValueError):
    """`max_tokens` above the server's cap, or prompt + `max_tokens` beyond the engine's context (HTTP 400).
    `index`: the request of the engine call whose prompt does not fit (None: the call as a whole)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class Unauthorized(ValueError):
    """No `Authorization: Bearer <token>`, or another token (HTTP 401)."""


class BodyTooLarge(ValueError):
    """A request body above its path's limit, declared or counted (HTTP 413)."""


class BodyTimeout(ValueError):
    """A request body not complete within the body deadline (HTTP 408)."""


def check_token(authorization: str | None, expected: str | None) -> None:
    """`Unauthorized` unless the server has no token or the header carries it."""
    if expected is not None and not bearer_ok(authorization, expected):
        raise Unauthorized("missing or wrong bearer token")


@dataclass
class BodyBudget:
    """The size limit and the deadline of one request body, from the moment the request started."""

    limit: int  # bytes
    timeout_s: float
    deadline: float = field(default=0.0)  # time.monotonic() by which the whole body must be in

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    def declared(self, length: int) -> None:
        """`BodyTooLarge` for a declared Content-Length above the limit (refused before any body byte)."""
        if length > self.limit:
            raise BodyTooLarge(f"request body of {length} bytes exceeds {self.limit}")

    def received(self, total: int) -> None:
        """`BodyTooLarge` once more than the limit arrived (a body without a declared length)."""
        if total > self.limit:
            raise BodyTooLarge(f"request body exceeds {self.limit} bytes")

    def remaining_s(self) -> float:
        """Seconds left for the rest of the body; `BodyTimeout` when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def expired(self) -> BodyTimeout:
        return BodyTimeout(f"request body not received within {self.timeout_s:g} s")


def validation_detail(
    errors: Iterable[Mapping[str, Any]], content_type: str | None = None
) -> tuple[str, list[dict[str, str]]]:
    """The 422 answer of a query or body that failed its model: one `field: message` per error (the field
    without pydantic's `body` / `query` prefix), joined, and the list. A body that is not JSON says so:
    where its JSON breaks, or (`content_type` not JSON, so the body was never parsed) which header to send."""
    listed = [_error_entry(err, content_type) for err in errors]
    return "; ".join(f"{e['field']}: {e['message']}" for e in listed), listed


def _error_entry(err: Mapping[str, Any], content_type: str | None) -> dict[str, str]:
    path = _field_path(err["loc"])
    if err.get("type") == "json_invalid":  # FastAPI's loc is ("body", <character offset>), not a field
        offset = path[0] if path else "?"
        reason = (err.get("ctx") or {}).get("error", "")
        return {"field": "<body>", "message": f"invalid JSON at character {offset}: {reason}".rstrip(": ")}
    if not path and not is_json_content_type(content_type):  # FastAPI kept the raw bytes: never parsed
        given = "no Content-Type" if not content_type else f"Content-Type {content_type!r}"
        return {
            "field": "<body>",
            "message": f"send the body as JSON with Content-Type: application/json ({given})",
        }
    return {"field": ".".join(str(p) for p in path) or "<body>", "message": str(err["msg"])}


def is_json_content_type(content_type: str | None) -> bool:
    """Whether a Content-Type header makes FastAPI parse the body as JSON (`application/json`, `+json`)."""
    if content_type is None:
        return True  # the caller did not say (not an HTTP body): nothing to report about the header
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _field_path(loc: Sequence[Any]) -> list[Any]:
    return [p for p in loc if p not in ("body", "query")]


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


def check_context(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, index: int | None = None
) -> None:
    """`TooManyTokens` unless prompt + `max_tokens` fits the engine's context (called once the prompt is
    encoded, so the count is the engine's own). `index`: the request's place in the engine call, carried by
    the error so that its caller can name the request (`infer_requests[i]`, a Stage-B ticket)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise TooManyTokens(
            f"a prompt of {num_prompt_tokens} tokens + request_config.max_tokens {max_tokens} = "
            f"{num_prompt_tokens + max_tokens} exceeds the engine's max_model_len of {max_model_len} tokens",
            index,
        )
