"""Typed errors, one class per stable code of the gateway's error body.

Every failure the server answers is ``{"error": {"code", "message"}}`` with a status; the
class says the code, so callers branch on ``except NotYetVisible`` rather than on strings.
``retryable`` errors (busy, rate limited, unavailable, not yet visible) may succeed later.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = [
    "EngramError",
    "Invalid",
    "Unauthenticated",
    "Forbidden",
    "NotFound",
    "NotYetVisible",
    "Busy",
    "RateLimited",
    "TooLarge",
    "Conflict",
    "Unavailable",
    "Internal",
    "TransportError",
    "error_for",
]


class EngramError(Exception):
    """A request Engram refused or could not answer."""

    #: The stable code of the error body (``invalid``, ``forbidden``, ...).
    code: str = "internal"
    #: Whether the same request may succeed later.
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        if code is not None:
            self.code = code
        #: Seconds the server asked the caller to wait (the ``Retry-After`` header), if any.
        self.retry_after = retry_after
        #: The decoded response body, for anything the message leaves out.
        self.body = body

    def __str__(self) -> str:
        status = f"{self.status} " if self.status is not None else ""
        return f"{status}{self.code}: {self.message}"


class Invalid(EngramError):
    """400: the request is malformed, out of bounds, or names scopes it may not."""

    code = "invalid"


class Unauthenticated(EngramError):
    """401: no API key, a malformed one, or one the server does not know (revoked)."""

    code = "unauthenticated"


class Forbidden(EngramError):
    """403: the key may not do this (another tenant, a scope it holds no grant of)."""

    code = "forbidden"


class NotFound(EngramError):
    """404: the route does not exist on this server (an older engram)."""

    code = "not_found"


class NotYetVisible(EngramError):
    """408: a read-your-writes wait (``min_seq``) ran out; never stale results."""

    code = "not_yet_visible"
    retryable = True


class Busy(EngramError):
    """429: the endpoint has too many requests in flight; retry after a short pause."""

    code = "busy"
    retryable = True


class RateLimited(EngramError):
    """429: this key exceeds its request rate; ``retry_after`` says how long to wait."""

    code = "rate_limited"
    retryable = True


class TooLarge(EngramError):
    """413: the body or an event exceeds a size limit."""

    code = "too_large"


class Conflict(EngramError):
    """409: an optimistic-concurrency expectation did not hold."""

    code = "conflict"


class Unavailable(EngramError):
    """503: a service or the bus is unavailable."""

    code = "unavailable"
    retryable = True


class Internal(EngramError):
    """500: a bug or a broken read model."""

    code = "internal"


class TransportError(Unavailable):
    """The server could not be reached, or the connection failed mid-request."""

    code = "transport"


_BY_CODE: dict[str, type[EngramError]] = {
    cls.code: cls
    for cls in (
        Invalid,
        Unauthenticated,
        Forbidden,
        NotFound,
        NotYetVisible,
        Busy,
        RateLimited,
        TooLarge,
        Conflict,
        Unavailable,
        Internal,
    )
}

_BY_STATUS: dict[int, type[EngramError]] = {
    400: Invalid,
    401: Unauthenticated,
    403: Forbidden,
    404: NotFound,
    408: NotYetVisible,
    409: Conflict,
    413: TooLarge,
    429: Busy,
    503: Unavailable,
}


_STATUS_OF_CODE: dict[str, int] = {cls.code: status for status, cls in _BY_STATUS.items()}
_STATUS_OF_CODE.update({"rate_limited": 429, "internal": 500})


def status_of(code: str) -> int:
    """The HTTP status the gateway answers a code with."""
    return _STATUS_OF_CODE.get(code, 500)


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    if not headers:
        return None
    value = headers.get("retry-after") or headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def error_for(
    status: int, body: Any, headers: Mapping[str, str] | None = None
) -> EngramError:
    """The typed error of a failed response: by the body's code, else by the status."""
    code: str | None = None
    message = ""
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        code = body["error"].get("code")
        message = str(body["error"].get("message", ""))
    elif isinstance(body, str):
        message = body
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status) or Internal
    return cls(
        message or f"HTTP {status}",
        status=status,
        code=code if code and code not in _BY_CODE else None,
        retry_after=_retry_after(headers),
        body=body,
    )
