"""The errors of talking to a rollout server, shared by the client that raises them and the learner and
prefetcher that handle them (no HTTP library needed to catch them)."""

from __future__ import annotations


class RolloutRequestError(ValueError):
    """The server refused a request as malformed or not allowed (4xx): retrying cannot help."""


class RolloutServerError(RuntimeError):
    """A server failed a request even after the retry and the splits down to a single request."""


class RolloutRequestFailedError(RolloutServerError):
    """One request was answered HTTP 500 twice, after the client split its call down to it: the request
    itself may be what fails (a sample the server cannot take), so a retry of it can fail the same way."""


class ClientClosedError(RolloutServerError):
    """A call failed because its own client was closed meanwhile (the owner is shutting down): neither
    retried nor counted as a failure."""


class WrongVersionError(RolloutRequestError):
    """A server refused a call tagged with a weight version it no longer serves (HTTP 409): a sync was
    swapped in since the caller captured its version. Ask again at the current version."""
