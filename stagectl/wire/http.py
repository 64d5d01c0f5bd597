"""Reading a rollout server's HTTP answers, shared by the two clients that talk to it: the inference
client (`inference.client`) and the weight sync (`weightsync`), so neither imports the other."""

from __future__ import annotations

import httpx

from stagectl.wire.errors import RolloutRequestError
from stagectl.wire.protocol import VersionResponse


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
