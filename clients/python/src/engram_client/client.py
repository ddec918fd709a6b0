"""The HTTP clients: :class:`Engram` (blocking) and :class:`AsyncEngram` (asyncio).

Both are thin: every method is an operation of :mod:`engram_client._ops`, bound by
``bind_sync`` or ``bind_async`` (:mod:`engram_client._core`) to the client's transport, so
the two never drift apart. Only ``tail``, a stream rather than an exchange, is written for
each.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, TypeVar

import httpx

from . import _ops
from ._core import (
    AsyncSend,
    Context,
    Identity,
    Op,
    Request,
    Response,
    RetryPolicy,
    Scope,
    ScopeLike,
    adrive,
    drive,
)
from ._core import bind_async as _async
from ._core import bind_sync as _sync
from .errors import EngramError, TransportError, error_for
from .models import ReplayedEvent

T = TypeVar("T")

#: Where ``engram up`` serves by default; ``$ENGRAM_URL`` overrides it.
DEFAULT_URL = "http://127.0.0.1:7077"
#: Longer than the longest read-your-writes wait (60 s), plus room for the work.
DEFAULT_TIMEOUT = 75.0


def _response(r: httpx.Response) -> Response:
    body: Any
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return Response(r.status_code, body, r.headers)


def _httpx_args(request: Request, headers: Mapping[str, str]) -> dict[str, Any]:
    args: dict[str, Any] = {"params": request.params, "headers": dict(headers)}
    if request.body is not None:
        args["content"] = json.dumps(request.body)
        args["headers"]["content-type"] = "application/json"
    return args


def _headers(api_key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}", "user-agent": "engram-client-python"}


def _url(base_url: str | None) -> str:
    return base_url or os.environ.get("ENGRAM_URL") or DEFAULT_URL


def _key(api_key: str | None) -> str:
    key = api_key or os.environ.get("ENGRAM_API_KEY")
    if not key:
        raise ValueError("give an API key (engram key add), or set ENGRAM_API_KEY")
    return key


def _tail_params(ctx: Context, scope: ScopeLike | None, grants: Iterable[ScopeLike], after_seq: int) -> dict[str, str]:
    params = {"scope": str(ctx.scope(scope)), "after_seq": str(after_seq)}
    granted = ",".join(str(Scope.parse(g)) for g in grants)
    if granted:
        params["grants"] = granted
    return params


class _SseParser:
    """The tail's server-sent events, one at a time: ``memory`` events carry a replayed
    event (``{"seq", "stored_at", "event"}``) and the seq as their id; an ``error`` event
    (``{"error": {...}}``) ends the stream and is raised."""

    def __init__(self) -> None:
        self._event = "message"
        self._data: list[str] = []

    def feed(self, line: str) -> dict[str, Any] | None:
        if line == "":
            if not self._data:
                self._event = "message"
                return None
            data, event = "\n".join(self._data), self._event
            self._data, self._event = [], "message"
            body = json.loads(data)
            if event == "error":
                raise error_for(503, body)
            return body
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


class _Api:
    """What both clients hold: who the key is and the defaults of calls."""

    def __init__(
        self,
        api_key: str | None,
        *,
        scope: ScopeLike | None,
        instance_id: str | None,
        retry: RetryPolicy | None,
    ) -> None:
        self.api_key = _key(api_key)
        self.context = Context(
            Identity.of_key(self.api_key),
            default_scope=Scope.parse(scope) if scope is not None else None,
            instance_id=instance_id,
        )
        self.retry = retry or RetryPolicy()

    @property
    def tenant(self) -> str:
        return self.context.tenant

    @property
    def agent(self) -> str:
        return self.context.agent

    def event(self, text: str = "", **fields: Any) -> dict[str, Any]:
        """An event envelope for :meth:`append_batch` (a fresh UUIDv7 id, the key's
        tenant and agent); takes the keywords of :meth:`append`."""
        return _ops.event(self.context, text, **fields)


class Engram(_Api):
    """A blocking client of Engram's HTTP API.

    >>> mem = Engram("http://127.0.0.1:7077", api_key, scope="task:fix-login")
    >>> seq = mem.append("login fails with a 500", tags=["auth"])["seq"]
    >>> mem.retrieve("why does login fail", min_seq=seq)["results"][0]["text"]
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        scope: ScopeLike | None = None,
        instance_id: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(api_key, scope=scope, instance_id=instance_id, retry=retry)
        self._http = http_client or httpx.Client(base_url=_url(base_url), timeout=timeout)
        self._headers = _headers(self.api_key)

    def _send(self, request: Request) -> Response:
        try:
            r = self._http.request(request.method, request.path, **_httpx_args(request, self._headers))
        except httpx.TransportError as e:
            raise TransportError(f"{request.method} {request.path}: {e}") from e
        return _response(r)

    def run(self, op: Op[T]) -> T:
        """Runs an operation (of this package's adapters, say) on this client."""
        return drive(op, self._send, self.retry)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Engram:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tail(
        self, scope: ScopeLike | None = None, *, grants: Iterable[ScopeLike] = (), after_seq: int = 0
    ) -> Iterator[ReplayedEvent]:
        """The scope's events from ``after_seq`` on, then each as it is appended
        (``{"seq", "stored_at", "event"}``), until the caller stops iterating. A dropped
        connection is resumed after the last event seen (so no gap and no repeat), retried
        as the client's :class:`RetryPolicy` says."""
        attempt = 0
        while True:
            params = _tail_params(self.context, scope, grants, after_seq)
            try:
                with self._http.stream("GET", "/v1/tail", params=params, headers=self._headers, timeout=None) as r:
                    if r.status_code != 200:
                        r.read()
                        raise error_for(r.status_code, _response(r).body, r.headers)
                    parser = _SseParser()
                    for line in r.iter_lines():
                        item = parser.feed(line)
                        if item is not None:
                            after_seq, attempt = item["seq"], 0
                            yield item  # type: ignore[misc]
                return
            except (httpx.TransportError, EngramError) as e:
                error = e if isinstance(e, EngramError) else TransportError(f"GET /v1/tail: {e}")
                wait = self.retry.delay(attempt, error)
                if wait is None:
                    if error is e:
                        raise
                    raise error from e
                time.sleep(wait)
                attempt += 1

    request = _sync(_ops.raw)
    whoami = _sync(_ops.whoami)
    scopes = _sync(_ops.scopes)
    append = _sync(_ops.append)
    append_event = _sync(_ops.append_event)
    append_batch = _sync(_ops.append_batch)
    assert_fact = _sync(_ops.assert_fact)
    record_skill = _sync(_ops.record_skill)
    retrieve = _sync(_ops.retrieve)
    build_context = _sync(_ops.context)
    facts = _sync(_ops.facts)
    skills = _sync(_ops.skills)
    doc = _sync(_ops.doc)
    doc_value = _sync(_ops.doc_value)
    doc_conflicts = _sync(_ops.doc_conflicts)
    doc_history = _sync(_ops.doc_history)
    docs = _sync(_ops.docs)
    edit_doc = _sync(_ops.edit_doc)
    forget = _sync(_ops.forget)
    consolidate = _sync(_ops.consolidate)
    snapshots = _sync(_ops.snapshots)
    dead_letters = _sync(_ops.dead_letters)
    bootstrap = _sync(_ops.bootstrap)
    replay_page = _sync(_ops.replay_page)
    replay = _sync(_ops.replay)
    working_put = _sync(_ops.working_put)
    working_get = _sync(_ops.working_get)
    working_delete = _sync(_ops.working_delete)
    working_list = _sync(_ops.working_list)


class AsyncEngram(_Api):
    """The asyncio client: the methods of :class:`Engram`, awaited.

    Over HTTP by default; :func:`engram_client.nats.connect` gives one that speaks NATS.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        scope: ScopeLike | None = None,
        instance_id: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        http_client: httpx.AsyncClient | None = None,
        transport: AsyncSend | None = None,
    ) -> None:
        super().__init__(api_key, scope=scope, instance_id=instance_id, retry=retry)
        self._headers = _headers(self.api_key)
        self._http: httpx.AsyncClient | None = None
        if transport is not None:
            self._transport = transport
        else:
            self._http = http_client or httpx.AsyncClient(base_url=_url(base_url), timeout=timeout)
            self._transport = self._send
        self._closers: list[Callable[[], Awaitable[None]]] = []

    async def _send(self, request: Request) -> Response:
        assert self._http is not None
        try:
            r = await self._http.request(request.method, request.path, **_httpx_args(request, self._headers))
        except httpx.TransportError as e:
            raise TransportError(f"{request.method} {request.path}: {e}") from e
        return _response(r)

    async def run(self, op: Op[T]) -> T:
        """Runs an operation (of this package's adapters, say) on this client."""
        return await adrive(op, self._transport, self.retry)

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        self._closers.append(closer)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        for closer in self._closers:
            await closer()

    async def __aenter__(self) -> AsyncEngram:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def tail(
        self, scope: ScopeLike | None = None, *, grants: Iterable[ScopeLike] = (), after_seq: int = 0
    ) -> AsyncIterator[ReplayedEvent]:
        """The scope's events, then each as it is appended, as :meth:`Engram.tail`."""
        if self._http is None:
            raise NotImplementedError("tail is served over HTTP (GET /v1/tail)")
        attempt = 0
        while True:
            params = _tail_params(self.context, scope, grants, after_seq)
            try:
                async with self._http.stream(
                    "GET", "/v1/tail", params=params, headers=self._headers, timeout=None
                ) as r:
                    if r.status_code != 200:
                        await r.aread()
                        raise error_for(r.status_code, _response(r).body, r.headers)
                    parser = _SseParser()
                    async for line in r.aiter_lines():
                        item = parser.feed(line)
                        if item is not None:
                            after_seq, attempt = item["seq"], 0
                            yield item  # type: ignore[misc]
                return
            except (httpx.TransportError, EngramError) as e:
                error = e if isinstance(e, EngramError) else TransportError(f"GET /v1/tail: {e}")
                wait = self.retry.delay(attempt, error)
                if wait is None:
                    if error is e:
                        raise
                    raise error from e
                await asyncio.sleep(wait)
                attempt += 1

    request = _async(_ops.raw)
    whoami = _async(_ops.whoami)
    scopes = _async(_ops.scopes)
    append = _async(_ops.append)
    append_event = _async(_ops.append_event)
    append_batch = _async(_ops.append_batch)
    assert_fact = _async(_ops.assert_fact)
    record_skill = _async(_ops.record_skill)
    retrieve = _async(_ops.retrieve)
    build_context = _async(_ops.context)
    facts = _async(_ops.facts)
    skills = _async(_ops.skills)
    doc = _async(_ops.doc)
    doc_value = _async(_ops.doc_value)
    doc_conflicts = _async(_ops.doc_conflicts)
    doc_history = _async(_ops.doc_history)
    docs = _async(_ops.docs)
    edit_doc = _async(_ops.edit_doc)
    forget = _async(_ops.forget)
    consolidate = _async(_ops.consolidate)
    snapshots = _async(_ops.snapshots)
    dead_letters = _async(_ops.dead_letters)
    bootstrap = _async(_ops.bootstrap)
    replay_page = _async(_ops.replay_page)
    replay = _async(_ops.replay)
    working_put = _async(_ops.working_put)
    working_get = _async(_ops.working_get)
    working_delete = _async(_ops.working_delete)
    working_list = _async(_ops.working_list)
