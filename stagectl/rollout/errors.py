"""The errors of talking to a rollout server, shared by the client that raises them and the learner and
prefetcher that handle them (no HTTP library needed to catch them)."""

from __future__ import annotations


class RolloutRequestError(ValueError):
    """The server refused a request as malformed or not allowed (4xx): retrying cannot help."""


class RolloutServerError(RuntimeError):
    """A server failed a request even after the retry and the splits down to a single request."""


class WeightPushError(RuntimeError):
    """A weight sync failed; every server still serves its previous version. `unreachable`: a peer went
    away mid-sync (a server died), so the learner skips this sync and the next one retries, as for a
    connection error; otherwise the sync was refused and the run ends with the message."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class DeltaRefused(WeightPushError):
    """A server refused a delta sync (HTTP 409: it does not hold the named base version); a full sync is due."""
