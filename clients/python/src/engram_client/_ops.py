"""The native API as operations (see :mod:`engram_client._core`): each function builds its
requests, reads the answers and returns the result, without doing any I/O, so the sync and
async clients (and the NATS transport) run the very same code."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from ._core import Context, Op, Request, Scope, ScopeLike, call, rfc3339, uuid7
from .errors import NotFound, error_for, status_of
from .models import (
    AppendResult,
    ConsolidateResponse,
    BootstrapResponse,
    DocConflict,
    ContextResponse,
    DocEditResponse,
    DocResponse,
    FactsResponse,
    Receipt,
    ReplayedEvent,
    ReplayResponse,
    RetrieveResponse,
    ScopeInfo,
    SkillsResponse,
    Whoami,
    WorkingEntry,
)

#: Most events one append request carries (the gateway's bound).
MAX_BATCH = 1000


def _drop_none(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def scoped(
    ctx: Context,
    /,
    scope: ScopeLike | None,
    grants: Iterable[ScopeLike] = (),
    **fields: Any,
) -> dict[str, Any]:
    """A request body of the query protocol: tenant (always the key's), scope, grants and
    the fields given (None left out, so the server's defaults apply)."""
    body: dict[str, Any] = {"tenant": ctx.tenant, "scope": ctx.scope(scope).json()}
    grants = [Scope.parse(g).json() for g in grants]
    if grants:
        body["grants"] = grants
    body.update(_drop_none(fields))
    return body


def event(
    ctx: Context,
    /,
    text: str = "",
    *,
    scope: ScopeLike | None = None,
    layer: str = "episodic",
    kind: str = "observation",
    data: Any = None,
    tags: Sequence[str] = (),
    importance: float | None = None,
    caused_by: str | None = None,
    correlation_id: str | None = None,
    occurred_at: datetime | None = None,
    event_id: str | None = None,
    embedding: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """An event envelope (schemas/json/envelope.v1.json) with a fresh UUIDv7 id, so a
    retried append of it is stored once."""
    content: dict[str, Any] = {"text": text}
    if data is not None:
        content["data"] = data
    envelope = {
        "event_id": event_id or uuid7(),
        "tenant": ctx.tenant,
        "agent_id": ctx.agent,
        "instance_id": ctx.instance_id,
        "scope": ctx.scope(scope).json(),
        "layer": layer,
        "kind": kind,
        "content": content,
        "tags": list(tags),
        "importance": importance,
        "causation_id": caused_by,
        "correlation_id": correlation_id,
        "occurred_at": rfc3339(occurred_at) if occurred_at else None,
        "embedding": dict(embedding) if embedding else None,
    }
    return _drop_none(envelope)


def _complete(ctx: Context, /, e: Mapping[str, Any]) -> dict[str, Any]:
    """An event as given, with the id a retry needs and the caller's identity."""
    out = dict(e)
    out.setdefault("event_id", uuid7())
    out.setdefault("tenant", ctx.tenant)
    out.setdefault("agent_id", ctx.agent)
    if ctx.instance_id is not None:
        out.setdefault("instance_id", ctx.instance_id)
    if "scope" in out:
        out["scope"] = Scope.parse(out["scope"]).json()
    elif ctx.default_scope is not None:
        out["scope"] = ctx.default_scope.json()
    return out


def append_batch(ctx: Context, /, events: Sequence[Mapping[str, Any]]) -> Op[list[AppendResult]]:
    """Appends events (any number, sent 1000 at a time; each request is checked whole by
    the server). Returns one result per event, in order: its ``seq`` or its ``error``."""
    results: list[AppendResult] = []
    complete = [_complete(ctx, e) for e in events]
    for start in range(0, len(complete), MAX_BATCH):
        body = yield from call(Request("POST", "/v1/events", complete[start : start + MAX_BATCH]))
        results.extend(body["results"])
    return results


def append_event(ctx: Context, /, e: Mapping[str, Any]) -> Op[Receipt]:
    """Appends one event; raises its typed error if it was not stored."""
    (result,) = yield from append_batch(ctx, [e])
    if result.get("error"):
        err: dict[str, Any] = dict(result["error"] or {})
        raise error_for(status_of(str(err.get("code"))), {"error": err})
    return {"event_id": result["event_id"], "seq": result["seq"] or 0, "duplicate": result["duplicate"]}


def append(
    ctx: Context,
    /,
    text: str = "",
    *,
    scope: ScopeLike | None = None,
    layer: str = "episodic",
    kind: str = "observation",
    data: Any = None,
    tags: Sequence[str] = (),
    importance: float | None = None,
    caused_by: str | None = None,
    correlation_id: str | None = None,
    occurred_at: datetime | None = None,
    event_id: str | None = None,
    embedding: Mapping[str, Any] | None = None,
) -> Op[Receipt]:
    """Appends one event (see :func:`event`) and returns its receipt: ``seq`` is the
    read-your-writes token (pass it as ``min_seq``); ``duplicate`` says a retry of the same
    ``event_id`` found it stored already."""
    e = event(
        ctx, text, scope=scope, layer=layer, kind=kind, data=data, tags=tags, importance=importance,
        caused_by=caused_by, correlation_id=correlation_id, occurred_at=occurred_at,
        event_id=event_id, embedding=embedding,
    )
    return (yield from append_event(ctx, e))


def whoami(ctx: Context, /) -> Op[Whoami]:
    """The key's tenant, agent, scopes (``kind:id`` or ``kind:*``) and read-only grants."""
    return (yield from call(Request("GET", "/v1/whoami")))


def scopes(ctx: Context, /, *, limit: int | None = None) -> Op[list[ScopeInfo]]:
    """The scopes of the tenant holding events that this key may read, with counts."""
    body = yield from call(Request("POST", "/v1/scopes", _drop_none({"tenant": ctx.tenant, "limit": limit})))
    return list(body["scopes"])


def retrieve(
    ctx: Context,
    /,
    query: str,
    *,
    scope: ScopeLike | None = None,
    grants: Iterable[ScopeLike] = (),
    top_k: int | None = None,
    mode: str | None = None,
    filter: Mapping[str, Any] | None = None,
    min_seq: int | None = None,
    wait_ms: int | None = None,
    ranking: Mapping[str, Any] | None = None,
    vector: Sequence[float] | None = None,
) -> Op[RetrieveResponse]:
    """Hybrid retrieval (``mode``: hybrid, dense, keyword) with score parts."""
    body = scoped(
        ctx, scope, grants, query=query, top_k=top_k, mode=mode,
        filter=dict(filter) if filter else None, min_seq=min_seq, wait_ms=wait_ms,
        ranking=dict(ranking) if ranking else None, vector=list(vector) if vector else None,
    )
    return (yield from call(Request("POST", "/v1/retrieve", body)))


def context(
    ctx: Context,
    /,
    query: str,
    *,
    task: str,
    token_budget: int = 1024,
    scope: ScopeLike | None = None,
    grants: Iterable[ScopeLike] = (),
    agent_id: str | None = None,
    min_seq: int | None = None,
    wait_ms: int | None = None,
) -> Op[ContextResponse]:
    """The memory for one agent step, within ``token_budget`` tokens."""
    body = scoped(
        ctx, scope, grants, query=query, task=task, token_budget=token_budget,
        agent_id=agent_id or ctx.agent, min_seq=min_seq, wait_ms=wait_ms,
    )
    return (yield from call(Request("POST", "/v1/context", body)))


def facts(
    ctx: Context,
    /,
    *,
    scope: ScopeLike | None = None,
    grants: Iterable[ScopeLike] = (),
    subject: str | None = None,
    predicate: str | None = None,
    text: str | None = None,
    valid_at: datetime | None = None,
    known_at: datetime | None = None,
    history: bool | None = None,
    limit: int | None = None,
    min_seq: int | None = None,
    wait_ms: int | None = None,
) -> Op[FactsResponse]:
    """Facts as they are now, as of ``valid_at``, as known at ``known_at``, or (``history``)
    every version."""
    body = scoped(
        ctx, scope, grants, subject=subject, predicate=predicate, text=text,
        valid_at=rfc3339(valid_at) if valid_at else None,
        known_at=rfc3339(known_at) if known_at else None,
        history=history, limit=limit, min_seq=min_seq, wait_ms=wait_ms,
    )
    return (yield from call(Request("POST", "/v1/facts", body)))


def assert_fact(
    ctx: Context,
    /,
    subject: str,
    predicate: str,
    object: Any,
    *,
    scope: ScopeLike | None = None,
    text: str | None = None,
    cardinality: str | None = None,
    confidence: float | None = None,
    valid_from: datetime | None = None,
    valid_to: datetime | None = None,
    **fields: Any,
) -> Op[Receipt]:
    """Appends a ``fact_asserted`` event (semantic layer)."""
    data = _drop_none({
        "subject": subject, "predicate": predicate, "object": object,
        "cardinality": cardinality, "confidence": confidence,
        "valid_from": rfc3339(valid_from) if valid_from else None,
        "valid_to": rfc3339(valid_to) if valid_to else None,
    })
    fields.setdefault("layer", "semantic")
    return (yield from append(
        ctx, text if text is not None else f"{subject} {predicate} {object}",
        scope=scope, kind="fact_asserted", data=data, **fields,
    ))


def skills(
    ctx: Context,
    /,
    *,
    scope: ScopeLike | None = None,
    grants: Iterable[ScopeLike] = (),
    task: str | None = None,
    name: str | None = None,
    limit: int | None = None,
    min_seq: int | None = None,
    wait_ms: int | None = None,
) -> Op[SkillsResponse]:
    """One skill by ``name``, or the skills best matching ``task``."""
    body = scoped(ctx, scope, grants, task=task, name=name, limit=limit, min_seq=min_seq, wait_ms=wait_ms)
    return (yield from call(Request("POST", "/v1/skills", body)))


def record_skill(
    ctx: Context,
    /,
    name: str,
    description: str,
    *,
    steps: Sequence[str] = (),
    scope: ScopeLike | None = None,
    version: int | None = None,
    **fields: Any,
) -> Op[Receipt]:
    """Appends a ``skill_recorded`` event (procedural layer)."""
    data = _drop_none({"name": name, "description": description, "steps": list(steps), "version": version})
    fields.setdefault("layer", "procedural")
    return (yield from append(ctx, description, scope=scope, kind="skill_recorded", data=data, **fields))


def doc(
    ctx: Context,
    /,
    doc_type: str,
    name: str,
    *,
    scope: ScopeLike | None = None,
    include_bytes: bool | None = None,
    min_seq: int | None = None,
    wait_ms: int | None = None,
) -> Op[DocResponse]:
    """A shared document's state: ``doc`` (its ``value``, or None if it does not exist yet)
    and ``conflicts`` (every value of each field written concurrently, the winner first)."""
    body = scoped(
        ctx, scope, read="state", doc_type=doc_type, name=name,
        include_bytes=include_bytes, min_seq=min_seq, wait_ms=wait_ms,
    )
    return (yield from call(Request("POST", "/v1/docs", body)))


def doc_value(ctx: Context, /, doc_type: str, name: str, **fields: Any) -> Op[Any]:
    """A document's current value, or None when it does not exist."""
    response = yield from doc(ctx, doc_type, name, **fields)
    return (response.get("doc") or {}).get("value")


def doc_conflicts(ctx: Context, /, doc_type: str, name: str, **fields: Any) -> Op[list[DocConflict]]:
    """The fields of a document written concurrently, each with every value it holds."""
    response = yield from doc(ctx, doc_type, name, **fields)
    return list(response.get("conflicts", []))


def doc_history(
    ctx: Context,
    /,
    doc_type: str,
    name: str,
    *,
    scope: ScopeLike | None = None,
    limit: int | None = None,
    min_seq: int | None = None,
) -> Op[DocResponse]:
    body = scoped(ctx, scope, read="history", doc_type=doc_type, name=name, limit=limit, min_seq=min_seq)
    return (yield from call(Request("POST", "/v1/docs", body)))


def docs(
    ctx: Context,
    /,
    *,
    scope: ScopeLike | None = None,
    grants: Iterable[ScopeLike] = (),
    doc_type: str | None = None,
    include_values: bool | None = None,
    limit: int | None = None,
    min_seq: int | None = None,
) -> Op[DocResponse]:
    """The documents of the readable scopes (own scope and grants)."""
    body = scoped(
        ctx, scope, grants, read="list", doc_type=doc_type,
        include_values=include_values, limit=limit, min_seq=min_seq,
    )
    return (yield from call(Request("POST", "/v1/docs", body)))


def edit_doc(
    ctx: Context,
    /,
    doc_type: str,
    name: str,
    *,
    set: Mapping[str, Any] | Sequence[tuple[str, Any]] = (),
    delete: Sequence[str] = (),
    scope: ScopeLike | None = None,
    min_seq: int | None = None,
) -> Op[DocEditResponse]:
    """Edits a shared document in one change: ``set`` maps JSON-pointer paths
    (``/items/t-7/status``; maps on the way are made) to values, ``delete`` lists paths.
    Concurrent edits merge. The answer holds the change's ``seq`` (read it back with
    ``min_seq``) and the ``view`` after it: ``{"value", "conflicts", "truncated"}``."""
    pairs = list(set.items()) if isinstance(set, Mapping) else list(set)
    body = scoped(
        ctx, scope, doc_type=doc_type, name=name, min_seq=min_seq,
        set=[{"path": p, "value": v} for p, v in pairs], delete=list(delete),
    )
    return (yield from call(Request("POST", "/v1/docs/edit", body)))


def forget(
    ctx: Context,
    /,
    event_ids: Sequence[str],
    *,
    reason: str,
    scope: ScopeLike | None = None,
    layer: str | None = None,
) -> Op[Receipt]:
    """Withdraws memories of ``scope`` from retrieval (a ``forgotten`` event; still in the
    log). Wait on the answer's ``seq`` (``min_seq``) to see them gone."""
    body = scoped(ctx, scope, event_ids=list(event_ids), reason=reason, layer=layer)
    try:
        return (yield from call(Request("POST", "/v1/forget", body)))
    except NotFound:
        # A gateway older than /v1/forget: the same `forgotten` event, appended.
        receipt = yield from append(
            ctx, reason, scope=scope, layer=layer or "episodic", kind="forgotten",
            data={"event_ids": list(event_ids)},
        )
        return receipt


def consolidate(
    ctx: Context,
    /,
    *,
    scope: ScopeLike | None = None,
    steps: Sequence[str] = (),
    restore: Sequence[str] = (),
    min_seq: int | None = None,
    wait_ms: int | None = None,
) -> Op[ConsolidateResponse]:
    """Consolidates one scope now: the consolidator plans (merged near-duplicates, the
    summary of a finished session, archived memories; ``steps`` of dedup, summarise,
    decay, or ``restore`` these archived ids) and the gateway appends the plan as the key's
    agent. Returns ``{"planned", "results"}``; a retry stores each output once."""
    body = scoped(
        ctx, scope, steps=list(steps) or None, restore=list(restore) or None,
        min_seq=min_seq, wait_ms=wait_ms,
    )
    return (yield from call(Request("POST", "/v1/consolidate", body)))


def snapshots(ctx: Context, /, *, projector: str | None = None) -> Op[list[dict[str, Any]]]:
    """The snapshot index: every read model's snapshots (or ``projector``'s), oldest first."""
    body = yield from call(Request("POST", "/v1/snapshots", _drop_none({"projector": projector})))
    return list(body.get("snapshots", []))


def dead_letters(ctx: Context, /, *, limit: int | None = None) -> Op[dict[str, Any]]:
    """The newest events a projector refused, of the scopes this key may read:
    ``{"dead_letters": [...], "total"}``."""
    body = _drop_none({"tenant": ctx.tenant, "limit": limit})
    return (yield from call(Request("POST", "/v1/dead_letters", body)))


def bootstrap(
    ctx: Context,
    /,
    model: str,
    *,
    scope: ScopeLike | None = None,
    grants: Iterable[ScopeLike] = (),
    version: int | None = None,
    min_seq: int | None = None,
) -> Op[BootstrapResponse]:
    """The slice of ``model``'s (facts, skills, docs) newest snapshot the scopes may read."""
    body = scoped(ctx, scope, grants, model=model, version=version, min_seq=min_seq)
    return (yield from call(Request("POST", "/v1/bootstrap", body)))


def replay_page(
    ctx: Context,
    /,
    *,
    scope: ScopeLike | None = None,
    grants: Iterable[ScopeLike] = (),
    after_seq: int = 0,
    limit: int | None = None,
) -> Op[ReplayResponse]:
    """One page of the scopes' events after ``after_seq``; page on with ``next_after``."""
    body = scoped(ctx, scope, grants, after_seq=after_seq, limit=limit)
    return (yield from call(Request("POST", "/v1/replay", body)))


def replay(
    ctx: Context,
    /,
    *,
    scope: ScopeLike | None = None,
    grants: Iterable[ScopeLike] = (),
    after_seq: int = 0,
    max_events: int | None = None,
) -> Op[list[ReplayedEvent]]:
    """Every event of the scopes after ``after_seq`` (at most ``max_events``), in stream
    order: how a fresh instance rebuilds its memory."""
    grants = list(grants)
    events: list[ReplayedEvent] = []
    while True:
        page = yield from replay_page(ctx, scope=scope, grants=grants, after_seq=after_seq, limit=1000)
        events.extend(page["events"])
        if max_events is not None and len(events) >= max_events:
            return events[:max_events]
        if page["done"] or page["next_after"] <= after_seq:
            return events
        after_seq = page["next_after"]


def _working(ctx: Context, /, scope: ScopeLike | None, op: str, **fields: Any) -> Op[dict[str, Any]]:
    return (yield from call(Request("POST", "/v1/working", scoped(ctx, scope, op=op, **fields))))


def working_put(
    ctx: Context, key: str, value: str, *, scope: ScopeLike | None = None, ttl_ms: int | None = None
) -> Op[int]:
    """Sets a working-memory key of the scope (expiring after ``ttl_ms``, or the
    deployment's default); returns its revision."""
    response = yield from _working(ctx, scope, "put", key=key, value=value, ttl_ms=ttl_ms)
    return int(response.get("revision") or 0)


def working_get(ctx: Context, /, key: str, *, scope: ScopeLike | None = None) -> Op[str | None]:
    response = yield from _working(ctx, scope, "get", key=key)
    entries = response.get("entries") or []
    return entries[0]["value"] if entries else None


def working_delete(ctx: Context, /, key: str, *, scope: ScopeLike | None = None) -> Op[None]:
    yield from _working(ctx, scope, "delete", key=key)
    return None


def working_list(ctx: Context, /, *, scope: ScopeLike | None = None) -> Op[list[WorkingEntry]]:
    """The scope's live entries (bounded by the server: 64 at most)."""
    response = yield from _working(ctx, scope, "list")
    return list(response.get("entries") or [])


def raw(ctx: Context, /, method: str, path: str, body: Any = None) -> Op[Any]:
    """Any route, as is: the body of its answer, or its typed error."""
    return (yield from call(Request(method, path, body)))
