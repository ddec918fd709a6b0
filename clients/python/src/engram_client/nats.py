"""The async API over NATS, for agents that hold their key's credentials and reach the
nats-server (extra ``engram-client[nats]``).

:func:`connect` returns an :class:`~engram_client.AsyncEngram` whose transport is NATS: the
same operations (and so the same adapters) run on it. It connects with the key's nkey seed
and the inbox prefix ``_INBOX.a.<tenant>.<agent>``, the only subjects an agent may
receive on. What each request becomes:

- appends (``/v1/events``, and ``forget``, which is a ``forgotten`` event): a JetStream
  publish of the MessagePack envelope on ``engram.evt.<tenant>.<scope kind>.<scope
  id>.<layer>`` with ``Nats-Msg-Id`` = event id (a retry is stored once), ``Engram-Kind``
  and ``traceparent``, answered by the stream's PubAck. An agent has no ``$JS.API`` access,
  and needs none for this.
- queries: JSON request/reply on ``engram.q.<tenant>.<agent>.<op>`` (retrieve, context,
  facts, skills, doc, replay, working, bootstrap, snapshots, whoami, scopes,
  dead_letters), with
  ``Engram-Timeout-Ms``;
  a failure is a reply with the ``Nats-Service-Error-Code`` header (an HTTP status) and
  ``Nats-Service-Error`` (the message), mapped to the same typed errors as HTTP.

The gateway-only routes (docs/edit, consolidate, tail) answer
:class:`~engram_client.errors.NotFound` here: use the HTTP client for them.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Mapping

import msgpack  # type: ignore[import-untyped]
import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError

from ._core import LAYERS, Identity, Request, Response, RetryPolicy, Scope, ScopeLike, check_ident, rfc3339, uuid7
from .client import AsyncEngram

__all__ = ["connect", "NatsTransport"]

EVENT_KINDS = (
    "observation", "action", "outcome", "fact_asserted", "fact_retracted", "skill_recorded",
    "preference", "feedback", "checkpoint", "forgotten", "doc_changed", "consolidated",
)
SCHEMA_VERSION = 1
#: Routes answered by the query service, by their op token.
QUERY_OPS = {
    "/v1/retrieve": "retrieve",
    "/v1/context": "context",
    "/v1/facts": "facts",
    "/v1/skills": "skills",
    "/v1/docs": "doc",
    "/v1/replay": "replay",
    "/v1/working": "working",
    "/v1/bootstrap": "bootstrap",
    "/v1/snapshots": "snapshots",
    "/v1/whoami": "whoami",
    "/v1/scopes": "scopes",
    "/v1/dead_letters": "dead_letters",
}
_CODE_OF_STATUS = {400: "invalid", 403: "forbidden", 408: "not_yet_visible", 429: "busy", 503: "unavailable"}


def _error(status: int, code: str, message: str, retry_after: float | None = None) -> Response:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
    return Response(status, {"error": {"code": code, "message": message}}, headers)


def _traceparent() -> str:
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"


class NatsTransport:
    """Sends the client's requests over one NATS connection (see the module docs)."""

    def __init__(self, nc: Any, identity: Identity, *, instance_id: str = "py", ack_timeout: float = 10.0) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.identity = identity
        self.instance_id = instance_id
        self.ack_timeout = ack_timeout
        #: Publishes waiting for their ack, by subject: the server refuses a publish the
        #: key may not make asynchronously (no ack ever comes), so each waits for either.
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}

    async def error_cb(self, e: Exception) -> None:
        text = str(e)
        marker = "permissions violation for publish to"
        at = text.lower().find(marker)
        if at < 0:
            return
        subject = text[at + len(marker) :].strip().strip("\"'")
        for waiter in self._waiting.get(subject, []):
            if not waiter.done():
                waiter.set_result(None)

    async def send(self, request: Request) -> Response:
        if request.path == "/v1/events":
            events = request.body if isinstance(request.body, list) else [request.body]
            return Response(200, {"results": await asyncio.gather(*(self._publish(e) for e in events))})
        if request.path == "/v1/forget":
            return await self._forget(request.body)
        op = QUERY_OPS.get(request.path)
        if op is None:
            return _error(404, "not_found", f"{request.method} {request.path} is served over HTTP only: use engram_client.AsyncEngram")
        return await self._query(op, request.body or {})

    def envelope(self, e: Mapping[str, Any]) -> dict[str, Any]:
        """The event as the stream stores it, checked as far as a client can, since the
        stream itself takes any bytes (and projectors would dead-letter a bad event)."""
        now = rfc3339()
        out = {
            "schema_version": SCHEMA_VERSION,
            "instance_id": self.instance_id,
            "occurred_at": now,
            "recorded_at": now,
            "importance": 0.5,
            "tags": [],
            **{k: v for k, v in e.items() if v is not None},
        }
        out.setdefault("event_id", uuid7())
        if out.get("tenant") != self.identity.tenant:
            raise ValueError(f"this key is of tenant {self.identity.tenant}; the event names {out.get('tenant')}")
        for field in ("tenant", "agent_id", "instance_id"):
            check_ident(field, out[field])
        out["scope"] = Scope.parse(out["scope"]).json()
        if out.get("layer") not in LAYERS:
            raise ValueError(f"layer {out.get('layer')!r}: use one of {', '.join(LAYERS)}")
        if out.get("kind") not in EVENT_KINDS:
            raise ValueError(f"kind {out.get('kind')!r}: use one of {', '.join(EVENT_KINDS)}")
        content = out.get("content") or {}
        if not content.get("text") and content.get("data") is None:
            raise ValueError("content: give a text or data")
        if not 0.0 <= float(out["importance"]) <= 1.0:
            raise ValueError("importance: within 0.0..=1.0")
        return out

    async def _publish(self, e: Mapping[str, Any]) -> dict[str, Any]:
        try:
            event = self.envelope(e)
        except (ValueError, KeyError, TypeError) as err:
            return {"event_id": str(e.get("event_id", "")), "seq": None, "duplicate": False,
                    "error": {"code": "invalid", "message": str(err)}}
        scope = event["scope"]
        subject = f"engram.evt.{event['tenant']}.{scope['kind']}.{scope['id']}.{event['layer']}"
        headers = {"Nats-Msg-Id": event["event_id"], "Engram-Kind": event["kind"], "traceparent": _traceparent()}
        result: dict[str, Any] = {"event_id": event["event_id"], "seq": None, "duplicate": False, "error": None}
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(subject, []).append(refused)
        publish = asyncio.ensure_future(
            self.js.publish(subject, msgpack.packb(event, use_bin_type=True), headers=headers, timeout=self.ack_timeout)
        )
        try:
            await asyncio.wait({publish, refused}, return_when=asyncio.FIRST_COMPLETED)
            if refused.done() and not publish.done():
                publish.cancel()
                result["error"] = {"code": "forbidden", "message": f"this key may not append to {subject}"}
                return result
            ack = publish.result()
        except APIError as err:
            code = "conflict" if err.err_code == 10071 else "too_large" if "size" in str(err).lower() else "invalid"
            result["error"] = {"code": code, "message": f"the stream refused the event: {err}"}
        except (NatsTimeout, NoRespondersError) as err:
            result["error"] = {"code": "unavailable", "message": f"no ack for {subject}: {err!r}"}
        else:
            result["seq"] = ack.seq
            result["duplicate"] = bool(ack.duplicate)
        finally:
            waiters = self._waiting.get(subject, [])
            if refused in waiters:
                waiters.remove(refused)
            if not waiters:
                self._waiting.pop(subject, None)
        return result

    async def _forget(self, body: Mapping[str, Any]) -> Response:
        event = {
            "tenant": body.get("tenant", self.identity.tenant),
            "agent_id": self.identity.agent,
            "scope": body["scope"],
            "layer": body.get("layer") or "episodic",
            "kind": "forgotten",
            "content": {"text": body.get("reason", ""), "data": {"event_ids": list(body["event_ids"])}},
        }
        result = await self._publish(event)
        if result["error"]:
            err = result["error"]
            return _error(403 if err["code"] == "forbidden" else 400 if err["code"] == "invalid" else 503, err["code"], err["message"])
        return Response(200, {"seq": result["seq"], "event_id": result["event_id"], "duplicate": result["duplicate"]})

    async def _query(self, op: str, body: Mapping[str, Any]) -> Response:
        subject = f"engram.q.{self.identity.tenant}.{self.identity.agent}.{op}"
        wait = body.get("wait_ms")
        wait_ms = wait if isinstance(wait, int) else 5000
        timeout = wait_ms / 1000 + 15.0
        headers = {"Engram-Timeout-Ms": str(int(timeout * 1000))}
        try:
            reply = await self.nc.request(subject, json.dumps(body).encode(), timeout=timeout, headers=headers)
        except NoRespondersError:
            return _error(503, "unavailable", f"no engram service answers on {subject}; is engram up running?")
        except NatsTimeout:
            return _error(503, "unavailable", f"request to {subject} timed out after {timeout} s")
        code = (reply.headers or {}).get("Nats-Service-Error-Code")
        if code:
            status = int(code) if code.isdigit() else 500
            message = (reply.headers or {}).get("Nats-Service-Error", f"service error {status}")
            return _error(status, _CODE_OF_STATUS.get(status, "internal"), message, 0.1 if status == 429 else None)
        return Response(200, json.loads(reply.data))


async def connect(
    url: str,
    api_key: str,
    *,
    scope: ScopeLike | None = None,
    instance_id: str = "py",
    retry: RetryPolicy | None = None,
    **options: Any,
) -> AsyncEngram:
    """An :class:`~engram_client.AsyncEngram` over NATS at ``url`` as the key's agent;
    ``options`` go to ``nats.connect``. Close it with ``await client.aclose()``."""
    identity = Identity.of_key(api_key)
    transport: NatsTransport | None = None

    async def error_cb(e: Exception) -> None:
        if transport is not None:
            await transport.error_cb(e)

    options.setdefault("name", f"engram-client-py-{identity.agent}")
    nc = await nats.connect(
        url,
        nkeys_seed_str=identity.seed,
        inbox_prefix=f"_INBOX.a.{identity.tenant}.{identity.agent}",
        error_cb=error_cb,
        **options,
    )
    transport = NatsTransport(nc, identity, instance_id=instance_id)
    client = AsyncEngram(api_key=api_key, scope=scope, instance_id=instance_id, retry=retry, transport=transport.send)
    client.on_close(nc.drain)
    return client
