"""The errors of a weight sync, both sides. The server raises `WeightSyncError` and its subclasses (each
maps onto its own HTTP status); the learner's senders raise `WeightPushError` and its subclasses (one per
status that asks for a different reaction), so callers dispatch on the type, never on a message."""

from __future__ import annotations


class WeightSyncError(ValueError):
    """A sync was rejected (HTTP 400/409); the old weights keep serving."""


class NoGroupError(WeightSyncError):
    """A collective sync reached a server outside the learner's weight group (it restarted, or a failed
    sync dropped the group): HTTP 409, and the learner forms the group again."""


class DeltaBaseError(WeightSyncError):
    """A delta sync named a base version the server does not hold (HTTP 409): send a full sync."""


class WeightPushError(RuntimeError):
    """A weight sync failed; every server still serves its previous version. `unreachable`: a peer went
    away mid-sync (a server died), so the learner skips this sync and the next one retries, as for a
    connection error; otherwise the sync was refused and the run ends with the message."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class DeltaRefused(WeightPushError):
    """A server refused a delta sync (HTTP 409: it does not hold the named base version); a full sync is due."""


class NotInGroup(WeightPushError):
    """A server is outside the learner's weight group (HTTP 412: it restarted, or a failed sync dropped the
    group): the collective sender forms the group again, once."""


def status_of(exc: WeightSyncError) -> int:
    """The HTTP status of a refused sync, the same on the app's port and the weight-stream port: 409 a delta
    against a base this server does not hold (send a full sync), 412 a collective sync to a server outside
    the weight group (form it again), 400 anything else (the sync is wrong: retrying cannot help)."""
    if isinstance(exc, DeltaBaseError):
        return 409
    if isinstance(exc, NoGroupError):
        return 412
    return 400
