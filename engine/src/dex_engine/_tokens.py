"""Stream resume tokens: opaque, signed, bound to one flow and stream (E11)."""

from __future__ import annotations

import base64
import hashlib
import hmac

import msgspec

from ._errors import InvalidResumeTokenError


class _Position(msgspec.Struct, frozen=True, array_like=True):
    flow_id: str
    stream: str
    sequence: int


def make_token(secret: bytes, flow_id: str, stream: str, sequence: int) -> str:
    body = base64.urlsafe_b64encode(msgspec.json.encode(_Position(flow_id, stream, sequence))).rstrip(b"=")
    mac = hmac.new(secret, body, hashlib.sha256).digest()[:16]
    return (body + b"." + base64.urlsafe_b64encode(mac).rstrip(b"=")).decode()


def read_token(secret: bytes, token: str, flow_id: str, stream: str) -> int:
    """The last sequence the token's holder has seen; refuses forged or foreign tokens."""
    if not isinstance(token, str) or token.count(".") != 1 or not token.isascii():
        # Cut: a token comes from a client (a Last-Event-ID header, say), and the error is logged.
        raise InvalidResumeTokenError(f"resume token {token!r:.200} is malformed")
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
    return position.sequence
