"""Stream resume tokens: opaque, signed, bound to one flow and stream (E11).

A flow ID deleted and started again names a new flow whose sequences start from 1 again: a token of
the old one would skip the new one's events up to its sequence. So a token also names the flow's
incarnation, its start time in ms (flows.created_at), which the reader compares with the flow it
reads (read_events returns it; no query of its own).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

import msgspec

from ._errors import InvalidResumeTokenError, shown
from ._records import EventPage, StoredEvent


class _Position(msgspec.Struct, frozen=True, array_like=True):
    flow_id: str
    stream: str
    sequence: int
    # None in a token made before tokens named it: it cannot be told from one of the current flow,
    # so it is read as then (docs/engine.md, "Deleting closed flows and retention").
    started_ms: int | None = None
    # A digest of the event at `sequence`, the last one the holder saw (None: it saw none there, or
    # the token predates digests): a database crash may lose events a reader already saw (best-effort
    # ones are written without fsync) and hand their sequences to later events, which a token
    # holding only the sequence would skip.
    digest: str | None = None


@dataclass(frozen=True)
class TokenPosition:
    sequence: int  # the last sequence the token's holder has seen
    started_ms: int | None  # the flow's created_at when the token was made (None: an older token)
    digest: str | None = None  # event_digest of the event the holder saw at `sequence`, if any


def event_digest(event: StoredEvent) -> str:
    """A short digest of a stored event, all of it: whether the event at a sequence is still the one
    a reader saw."""
    h = hashlib.sha256()
    for part in (str(event.sequence).encode(), event.step_execution_id.encode(), str(event.attempt).encode()):
        h.update(len(part).to_bytes(8, "big") + part)
    h.update(event.value)
    return base64.urlsafe_b64encode(h.digest()[:12]).decode()


def make_token(secret: bytes, flow_id: str, stream: str, sequence: int, started_ms: int,
               digest: str | None = None) -> str:
    position = _Position(flow_id, stream, sequence, started_ms, digest)
    body = base64.urlsafe_b64encode(msgspec.json.encode(position)).rstrip(b"=")
    mac = hmac.new(secret, body, hashlib.sha256).digest()[:16]
    return (body + b"." + base64.urlsafe_b64encode(mac).rstrip(b"=")).decode()


def read_token(secret: bytes, token: str, flow_id: str, stream: str) -> TokenPosition:
    """Where the token's holder is; refuses forged or foreign tokens (the incarnation is checked by
    check_incarnation, once the flow is read)."""
    if not isinstance(token, str) or token.count(".") != 1 or not token.isascii():
        # Cut: a token comes from a client (a Last-Event-ID header, say), and the error is logged.
        raise InvalidResumeTokenError(f"resume token {shown(token, 200)} is malformed")
    body, _, mac = token.encode().partition(b".")
    expected = base64.urlsafe_b64encode(hmac.new(secret, body, hashlib.sha256).digest()[:16]).rstrip(b"=")
    if not hmac.compare_digest(expected, mac):
        raise InvalidResumeTokenError(
            "resume token was cut, altered, or issued by another database (its signature does not match); "
            "pass a token exactly as a read of this database returned it, or None to read from the start")
    try:
        position = msgspec.json.decode(base64.urlsafe_b64decode(body + b"=" * (-len(body) % 4)), type=_Position)
    except (msgspec.DecodeError, ValueError):
        raise InvalidResumeTokenError("resume token body is unreadable") from None
    if position.flow_id != flow_id or position.stream != stream:
        raise InvalidResumeTokenError(
            f"resume token belongs to flow {position.flow_id!r} stream {position.stream!r}, "
            f"not flow {flow_id!r} stream {stream!r}"
        )
    return TokenPosition(position.sequence, position.started_ms, position.digest)


def check_incarnation(position: TokenPosition, flow_id: str, started_ms: int) -> None:
    """Refuses a token of an earlier flow of this ID (deleted, then started again)."""
    if position.started_ms is not None and position.started_ms != started_ms:
        raise InvalidResumeTokenError(
            f"resume token belongs to an earlier flow {flow_id!r}, which was deleted and started again; "
            "its positions mean nothing in the new one: read from the start (resume_token=None)"
        )


def check_not_rewound(position: TokenPosition, flow_id: str, stream: str, page: EventPage) -> None:
    """Refuses a token whose last event is no longer stored as its holder saw it, though not trimmed:
    a database crash lost it (with the events the holder saw after the last durable commit) and its
    sequence, and maybe later ones, went to new events. Reading on after the token would skip those
    silently (a turn's end, say) and a long poll would wait for a sequence already past."""
    if position.digest is None or position.sequence < page.first_sequence:
        return  # no event to compare, or trimmed (capacity): `trimmed` tells the reader
    if page.at_after is not None and event_digest(page.at_after) == position.digest:
        return
    raise InvalidResumeTokenError(
        f"resume token is past the events stream {stream!r} of flow {flow_id!r} still has: its event "
        f"{position.sequence} is gone or another event now, so a database crash lost events this reader "
        "saw and later events took their sequences; read from the start (resume_token=None) and rebuild "
        "from the flow's state"
    )
