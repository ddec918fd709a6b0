"""What the sync and async clients share: requests as data, operations as generators.

An operation (``Op[T]``) is a generator that yields :class:`Request` values and is sent a
:class:`Response` for each, returning its result. It never does I/O itself, so every API
method, adapters included, is written once; :func:`drive` runs one with a blocking
transport and :func:`adrive` with an awaitable one. Retries (429 and 503, honouring
``Retry-After``, bounded) happen in the drivers, decided by :meth:`RetryPolicy.delay`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import (
    Any,
    Awaitable,
    Callable,
    Concatenate,
    Generator,
    Mapping,
    NamedTuple,
    ParamSpec,
    TypeVar,
    Union,
)

from .errors import EngramError, TransportError, error_for

T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S")

#: Kinds of scope, widest first.
SCOPE_KINDS = ("org", "team", "user", "agent", "task", "session")
LAYERS = ("working", "episodic", "semantic", "procedural")
_IDENT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Request:
    """One HTTP exchange an operation asks for."""

    method: str
    path: str
    body: Any = None
    params: Mapping[str, str] | None = None
    #: Whether this request may be retried on 429/503 (every Engram request is, because
    #: appends carry client-chosen event ids; kept explicit for the drivers).
    retry: bool = True


@dataclass
class Response:
    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)

    def ok(self) -> Any:
        """The body, or the typed error of a failed response."""
        if 200 <= self.status < 300:
            return self.body
        raise error_for(self.status, self.body, self.headers)


Op = Generator[Request, Response, T]


def call(request: Request) -> Op[Any]:
    """The body of one successful exchange (the building block of every operation)."""
    response = yield request
    return response.ok()


class Scope(NamedTuple):
    """Who shares a memory: a kind (org, team, user, agent, task, session) and an id."""

    kind: str
    id: str

    @classmethod
    def parse(cls, value: ScopeLike) -> Scope:
        """``"task:t1"``, ``("task", "t1")``, ``{"kind": "task", "id": "t1"}`` or a Scope."""
        if isinstance(value, Scope):
            return value
        if isinstance(value, str):
            kind, sep, ident = value.partition(":")
            if not sep:
                raise ValueError(f"scope {value!r}: write it as kind:id, for example task:t1")
        elif isinstance(value, Mapping):
            kind, ident = value["kind"], value["id"]
        else:
            kind, ident = value
        if kind not in SCOPE_KINDS:
            raise ValueError(f"scope kind {kind!r}: use one of {', '.join(SCOPE_KINDS)}")
        check_ident("scope id", ident)
        return cls(kind, ident)

    def json(self) -> dict[str, str]:
        return {"kind": self.kind, "id": self.id}

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


ScopeLike = Union[Scope, str, tuple[str, str], Mapping[str, Any]]


def check_ident(what: str, value: str) -> str:
    if not isinstance(value, str) or not _IDENT.fullmatch(value):
        raise ValueError(f"{what} {value!r}: use 1-64 of A-Z a-z 0-9 _ -")
    return value


def uuid7() -> str:
    """A fresh UUIDv7 (time-ordered), the event id Engram prefers."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= ((rand >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    return str(uuid.UUID(int=value))


def rfc3339(at: datetime | None = None) -> str:
    at = at or datetime.now(timezone.utc)
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return at.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Identity:
    """Who an API key is: ``egk.<tenant>.<agent>.<seed>``."""

    tenant: str
    agent: str
    seed: str

    @classmethod
    def of_key(cls, api_key: str) -> Identity:
        parts = api_key.strip().split(".")
        if len(parts) != 4 or parts[0] != "egk":
            raise ValueError("an API key is of the form egk.<tenant>.<agent>.<seed> (engram key add)")
        return cls(parts[1], parts[2], parts[3])


@dataclass
class Context:
    """What operations need to know about the caller and its defaults."""

    identity: Identity
    #: The scope a call uses when it names none.
    default_scope: Scope | None = None
    #: Stamped on events (``instance_id``); the gateway's default is ``gateway``.
    instance_id: str | None = None

    @property
    def tenant(self) -> str:
        return self.identity.tenant

    @property
    def agent(self) -> str:
        return self.identity.agent

    def scope(self, scope: ScopeLike | None) -> Scope:
        if scope is not None:
            return Scope.parse(scope)
        if self.default_scope is None:
            raise ValueError("give a scope (for example scope='task:t1'), or a default scope to the client")
        return self.default_scope


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of 429 (busy, rate limited) and 503 (unavailable), and of connections that
    failed before a response: at most ``max_retries`` times, waiting what ``Retry-After``
    says (else an exponential backoff from ``backoff``), never longer than ``max_wait``."""

    max_retries: int = 3
    backoff: float = 0.1
    max_wait: float = 10.0

    def delay(self, attempt: int, error: EngramError) -> float | None:
        """Seconds to wait before attempt ``attempt + 1``, or None to give up."""
        if attempt >= self.max_retries or error.status not in (429, 503, None):
            return None
        if error.status is None and not isinstance(error, TransportError):
            return None
        wait = error.retry_after if error.retry_after is not None else self.backoff * (2**attempt)
        return min(wait, self.max_wait)


SyncSend = Callable[[Request], Response]
AsyncSend = Callable[[Request], Awaitable[Response]]


def _retrying(policy: RetryPolicy, attempt: int, request: Request, result: Response | EngramError) -> float | None:
    if not request.retry:
        return None
    if isinstance(result, Response):
        if result.status not in (429, 503):
            return None
        error = error_for(result.status, result.body, result.headers)
    else:
        error = result
    return policy.delay(attempt, error)


def drive(op: Op[T], send: SyncSend, policy: RetryPolicy) -> T:
    """Runs an operation with a blocking transport."""
    try:
        request = next(op)
        while True:
            attempt = 0
            while True:
                try:
                    result: Response | EngramError = send(request)
                except TransportError as e:
                    result = e
                wait = _retrying(policy, attempt, request, result)
                if wait is None:
                    break
                time.sleep(wait)
                attempt += 1
            if isinstance(result, EngramError):
                request = op.throw(result)
            else:
                request = op.send(result)
    except StopIteration as done:
        return done.value


async def adrive(op: Op[T], send: AsyncSend, policy: RetryPolicy) -> T:
    """Runs an operation with an awaitable transport."""
    try:
        request = next(op)
        while True:
            attempt = 0
            while True:
                try:
                    result: Response | EngramError = await send(request)
                except TransportError as e:
                    result = e
                wait = _retrying(policy, attempt, request, result)
                if wait is None:
                    break
                await asyncio.sleep(wait)
                attempt += 1
            if isinstance(result, EngramError):
                request = op.throw(result)
            else:
                request = op.send(result)
    except StopIteration as done:
        return done.value


def bind_sync(op: Callable[Concatenate[S, P], Op[T]], target: str = "context") -> Callable[Concatenate[Any, P], T]:
    """A blocking method running ``op`` with ``self.<target>`` as its first argument."""

    @functools.wraps(op)
    def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.run(op(getattr(self, target), *args, **kwargs))

    return method


def bind_async(
    op: Callable[Concatenate[S, P], Op[T]], target: str = "context"
) -> Callable[Concatenate[Any, P], Awaitable[T]]:
    """The awaitable twin of :func:`bind_sync`."""

    @functools.wraps(op)
    async def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.run(op(getattr(self, target), *args, **kwargs))

    return method
