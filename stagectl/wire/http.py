"""Reading a rollout server's HTTP answers, shared by the two clients that talk to it: the inference
client (`inference.client`) and the weight sync (`weightsync`), so neither imports the other; and the
launcher's one look at the servers' `/health/` (`not_answering`), before any model loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from stagectl.wire.deadline import DeadlineClient
from stagectl.wire.errors import RolloutRequestError
from stagectl.wire.protocol import VersionResponse
from stagectl.wire.tls import client_context

if TYPE_CHECKING:
    from stagectl.config.plan import ServerList


def server_version(http: httpx.Client, base_url: str) -> VersionResponse:
    """One server's weight version. A server without `/version/` (a `swift rollout` or `swift deploy`
    server) is refused (`RolloutRequestError`): Channel-B training needs it."""
    response = http.get(f"{base_url}/version/")
    if response.status_code == 404:
        raise RolloutRequestError(
            f"{base_url} has no /version/: it is not a stagectl rollout server (a `swift rollout` "
            "server?). Channel-B training needs the weight version of every rollout and stagectl's weight "
            "sync, which a swift server gives neither of; serve with `stagectl rollout-server`. A swift "
            "server can serve inference only (Stage-B, eval): see docs/swift_interop.md"
        )
    raise_for_status(response, base_url, "/version/")
    return VersionResponse.model_validate(response.json())


def response_detail(response: httpx.Response) -> str:
    """The `detail` of an error answer (FastAPI's shape), else the start of its body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    return str(body.get("detail", body)) if isinstance(body, dict) else str(body)[:500]


def raise_for_status(response: httpx.Response, base_url: str, path: str) -> None:
    """`RolloutRequestError` naming the URL, the status and the server's detail on any 4xx/5xx."""
    if response.status_code >= 400:
        raise RolloutRequestError(
            f"{base_url}{path}: HTTP {response.status_code}: {response_detail(response)}"
        )


def not_answering(servers: ServerList, timeout_s: float = 2.0) -> list[str]:
    """`URL (why)` for each of `servers` that does not answer `/health/` with 200 now: one try each, no
    wait (the ranks' `RolloutClient.wait_healthy` waits for a server still starting; this says early that it
    will)."""
    https = any(url.startswith("https://") for url in servers.base_urls)
    verify = client_context(servers.tls_ca_file, skip_verify=servers.tls_skip_verify) if https else True
    down: list[str] = []
    with DeadlineClient(total_s=timeout_s, timeout=timeout_s, verify=verify) as http:  # a trickle fails too
        for url in servers.base_urls:
            try:
                response = http.get(f"{url}/health/")
            except httpx.HTTPError as exc:
                down.append(f"{url} ({type(exc).__name__}: {exc})")
                continue
            if response.status_code != 200:
                down.append(f"{url} (HTTP {response.status_code})")
    return down
