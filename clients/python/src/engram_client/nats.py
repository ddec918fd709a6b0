"""The async API over NATS, for agents that hold their key's credentials and reach the
nats-server (extra ``engram-client[nats]``).

:func:`connect` returns an :class:`~engram_client.AsyncEngram` whose transport is NATS: the
same operations (and so the same adapters) run on it. It connects with the key's nkey seed
and the inbox prefix ``_INBOX.a.<tenant>.<agent>``, the only subjects an agent may
receive on. What each request becomes:

- appends (``/v1/events``, and ``forget``, which is a ``forgotten`` event): a request to
  ``engram.q.<tenant>.<agent>.append`` with ``{"events": [envelope]}``; the query service
  checks the event against the key (tenant, agent, a scope it may write) and appends it
  with ``Nats-Msg-Id`` = ``<tenant>:<event id>``, so a retry is stored once. An agent's key
  publishes to no stream and has no ``$JS.API`` access.
- queries: JSON request/reply on ``engram.q.<tenant>.<agent>.<op>`` (retrieve, context,
  facts, skills, doc, replay, working, bootstrap, snapshots, whoami, scopes,
  dead_letters), with
  ``Engram-Timeout-Ms``; a query about one scope (retrieve, context, facts, skills, doc)
  goes to ``engram.q.<tenant>.<agent>.<op>.<kind>.<id>``, which the server maps to the
  memory node owning the scope's partition (one round trip), and to the unrouted subject
  only when no node answers there;
  a failure is a reply with the ``Nats-Service-Error-Code`` header (an HTTP status) and
  ``Nats-Service-Error`` (the message), mapped to the same typed errors as HTTP.

The gateway-only routes (docs/edit, consolidate, tail) answer
:class:`~engram_client.errors.NotFound` here: use the HTTP client for them.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ._core import _IDENT, LAYERS, SCOPE_KINDS, Identity, Request, Response, RetryPolicy, Scope, ScopeLike, check_ident, rfc3339, uuid7
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
#: Events one append request carries (``engram_memory::proto::limits::MAX_APPEND_EVENTS``).
MAX_APPEND_EVENTS = 256
_CODE_OF_STATUS = {400: "invalid", 403: "forbidden", 408: "not_yet_visible", 429: "busy", 503: "unavailable"}


#: The queries about one scope a memory node answers directly (``ROUTED_OPS`` of the query
#: service): sent on ``engram.q.<tenant>.<agent>.<op>.<kind>.<id>``, which the server maps
#: to the node owning the scope's partition, one round trip.
ROUTED_OPS = frozenset({"retrieve", "context", "facts", "skills", "doc"})


def routed_subject(identity: Identity, op: str, body: Mapping[str, Any]) -> str | None:
    """The routed subject of a query about the body's scope, or ``None`` for an op that is
    not routed or a body without a well-formed scope (the unrouted subject then carries it,
    and the service's own checks answer a bad one). Only the subject's first tokens name
    who asks; the service checks the body's scope against the subject's."""
    if op not in ROUTED_OPS:
        return None
    scope = body.get("scope")
    if not isinstance(scope, Mapping):
        return None
    kind, ident = scope.get("kind"), scope.get("id")
    if kind not in SCOPE_KINDS or not isinstance(ident, str) or not _IDENT.fullmatch(ident):
        return None
    return f"engram.q.{identity.tenant}.{identity.agent}.{op}.{kind}.{ident}"


def _error(status: int, code: str, message: str, retry_after: float | None = None) -> Response:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
    return Response(status, {"error": {"code": code, "message": message}}, headers)


class NatsTransport:
    """Sends the client's requests over one NATS connection (see the module docs)."""

    def __init__(self, nc: Any, identity: Identity, *, instance_id: str = "py", ack_timeout: float = 10.0) -> None:
        self.nc = nc
        self.identity = identity
        self.instance_id = instance_id
        self.ack_timeout = ack_timeout
        #: Queries about one scope sent on the unrouted subject because no node answered the
        #: routed one (see :func:`routed_subject`).
        self.unrouted = 0

    async def error_cb(self, e: Exception) -> None:
        """Server errors arrive here; every operation is a request with its own answer, so
        none waits on them."""

    async def send(self, request: Request) -> Response:
        if request.path == "/v1/events":
            events = request.body if isinstance(request.body, list) else [request.body]
            return Response(200, {"results": await self._append(events)})
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
        return (await self._append([e]))[0]

    async def _append(self, given: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Appends through the query service, in stream order, one request per
        ``MAX_APPEND_EVENTS``: an agent's key publishes to no stream (a JetStream publish is
        acknowledged at any reply subject the publisher names, so a key that could publish
        to the log could make the server write elsewhere). The service checks each event
        against this key and stores a retry once."""
        results: list[dict[str, Any]] = []
        valid: list[tuple[int, dict[str, Any]]] = []
        for e in given:
            result: dict[str, Any] = {"event_id": str(e.get("event_id", "")), "seq": None, "duplicate": False, "error": None}
            try:
                event = self.envelope(e)
            except (ValueError, KeyError, TypeError) as err:
                result["error"] = {"code": "invalid", "message": str(err)}
            else:
                result["event_id"] = event["event_id"]
                valid.append((len(results), event))
            results.append(result)
        for start in range(0, len(valid), MAX_APPEND_EVENTS):
            chunk = valid[start : start + MAX_APPEND_EVENTS]
            reply = await self._query("append", {"events": [event for _, event in chunk]})
            if reply.status != 200:
                error = (reply.body or {}).get("error", {})
                code = error.get("code", "unavailable")
                failure = {"code": "unavailable" if code in ("busy", "internal") else code,
                           "message": error.get("message", f"append failed with status {reply.status}")}
                for i, _ in chunk:
                    results[i]["error"] = dict(failure)
                continue
            for (i, _), outcome in zip(chunk, reply.body.get("results") or []):
                if outcome.get("error"):
                    results[i]["error"] = {"code": outcome["error"].get("kind", "rejected"),
                                           "message": outcome["error"].get("message", "")}
                else:
                    results[i]["seq"] = outcome.get("seq")
                    results[i]["duplicate"] = bool(outcome.get("duplicate"))
        return results

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
        payload = json.dumps(body).encode()
        reply = None
        routed = routed_subject(self.identity, op, body)
        if routed is not None:
            try:
                reply = await self.nc.request(routed, payload, timeout=timeout, headers=headers)
            except NoRespondersError:
                # No node owns the scope's partition now (a move under way), or nothing
                # serves routed queries: the query service answers instead, asking the
                # partition's owner itself. One more request, only when routing failed.
                self.unrouted += 1
            except NatsTimeout:
                return _error(503, "unavailable", f"request to {routed} timed out after {timeout} s")
        if reply is None:
            try:
                reply = await self.nc.request(subject, payload, timeout=timeout, headers=headers)
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
