"""A mem0-style ``Memory`` on Engram: ``add``, ``search``, ``get_all``, ``get``, ``update``,
``delete``, ``delete_all``, ``history``, with mem0's signatures and return shapes.

**Scopes.** The tenant is always the API key's. mem0's ids name the scope a memory lives
in, the narrowest one given: ``run_id`` -> ``session:<run_id>``, else ``agent_id`` ->
``agent:<agent_id>``, else ``user_id`` -> ``user:<user_id>``; with none, the key's own
agent scope ``agent:<agent>``. Every id given is also kept on the memory (as tags
``mem0-user-<id>`` and so on), and reads return only memories carrying all the ids asked
for, as mem0 filters. The key must be allowed the scope: keys get ``task:*``,
``session:*`` and ``agent:<agent>`` by default, so a user's memories need a key issued with
``--scope user:<id>`` (or a grant, which is read-only).

**Memories are events.** ``add`` appends a semantic ``observation`` tagged ``mem0`` per
message (no LLM extracts facts: ``infer`` is accepted and ignored); ``search`` is Engram's
hybrid retrieval; ``update`` appends the new text as a new memory caused by the old one
(``causation_id``, and ``supersedes`` in its data) and forgets the old one; ``delete``
forgets; ``history`` reads the chain back from the scope's events. So a memory's id changes
when it is updated, and every call taking an id follows the chain: ``get(old_id)``
returns the current version (under its own id), and ``update``/``delete``/``history`` of
an old id act on the chain.

**delete_all** forgets the mem0 memories of one scope, and only of a scope the key may
write: a scope named by the arguments that is not one of the key's own (``GET
/v1/whoami``) is refused with :class:`~engram_client.errors.Forbidden` before anything
is read, and the server would refuse the ``forgotten`` event anyway.

Each ``Memory`` keeps, per scope, the mem0 memories it has read so far and replays only the
scope's newer events on each call (``/v1/replay`` from the last sequence seen).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from . import _ops
from ._core import Context, Op, Scope, bind_async, bind_sync
from .client import AsyncEngram, Engram
from .errors import Forbidden, NotFound, error_for, status_of

__all__ = ["Memory", "AsyncMemory"]

TAG = "mem0"
_ID_KINDS = (("run_id", "session"), ("agent_id", "agent"), ("user_id", "user"))
_KINDS = {kind for _, kind in _ID_KINDS}


@dataclass
class _Mem:
    """One version of a memory, as its event says."""

    id: str
    seq: int
    text: str
    ids: dict[str, str]
    metadata: dict[str, Any]
    role: str | None
    agent: str
    occurred_at: str
    supersedes: str | None


@dataclass
class _Forgotten:
    seq: int
    id: str
    at: str
    reason: str


@dataclass
class _ScopeView:
    """The mem0 memories of one scope, up to ``after_seq``."""

    after_seq: int = 0
    mems: dict[str, _Mem] = field(default_factory=dict)
    forgotten: dict[str, _Forgotten] = field(default_factory=dict)
    superseded_by: dict[str, str] = field(default_factory=dict)

    def apply(self, replayed: Mapping[str, Any]) -> None:
        seq, e = replayed["seq"], replayed["event"]
        self.after_seq = max(self.after_seq, seq)
        content = e.get("content") or {}
        data = content.get("data") or {}
        if e.get("kind") == "forgotten":
            if e.get("agent_id") == "consolidator":
                # Merged or archived out of retrieval by consolidation: not deleted.
                return
            for event_id in data.get("event_ids", []):
                self.forgotten.setdefault(
                    event_id, _Forgotten(seq, e["event_id"], e["occurred_at"], content.get("text", ""))
                )
            return
        if TAG not in (e.get("tags") or []) or not isinstance(data.get(TAG), Mapping):
            return
        meta = data[TAG]
        mem = _Mem(
            id=e["event_id"],
            seq=seq,
            text=content.get("text", ""),
            ids={k: v for k, v in (meta.get("ids") or {}).items() if v},
            metadata=dict(meta.get("metadata") or {}),
            role=meta.get("role"),
            agent=e.get("agent_id", ""),
            occurred_at=e["occurred_at"],
            supersedes=meta.get("supersedes"),
        )
        self.mems[mem.id] = mem
        if mem.supersedes:
            self.superseded_by[mem.supersedes] = mem.id

    def head(self, memory_id: str) -> str:
        seen = {memory_id}
        while memory_id in self.superseded_by:
            memory_id = self.superseded_by[memory_id]
            if memory_id in seen:
                break
            seen.add(memory_id)
        return memory_id

    def chain(self, memory_id: str) -> list[_Mem]:
        """Every version, oldest first, of the memory ``memory_id`` is a version of."""
        head = self.head(memory_id)
        out: list[_Mem] = []
        current: str | None = head
        while current is not None and current in self.mems and len(out) <= len(self.mems):
            out.append(self.mems[current])
            current = self.mems[current].supersedes
        return list(reversed(out))

    def live(self) -> list[_Mem]:
        return [m for m in self.mems.values() if m.id not in self.forgotten and m.id not in self.superseded_by]

    def item(self, mem: _Mem, score: float | None = None) -> dict[str, Any]:
        chain = self.chain(mem.id)
        item: dict[str, Any] = {
            "id": mem.id,
            "memory": mem.text,
            "hash": hashlib.md5(mem.text.encode()).hexdigest(),
            "metadata": mem.metadata or None,
            "created_at": chain[0].occurred_at if chain else mem.occurred_at,
            "updated_at": mem.occurred_at if len(chain) > 1 else None,
        }
        if score is not None:
            item["score"] = score
        item.update(mem.ids)
        if mem.role:
            item["role"] = mem.role
        return item


def _matches(mem: _Mem, ids: Mapping[str, str], filters: Mapping[str, Any] | None) -> bool:
    if any(mem.ids.get(k) != v for k, v in ids.items()):
        return False
    for key, want in (filters or {}).items():
        have = mem.ids.get(key, mem.metadata.get(key))
        if want != "*" and have != want:
            return False
    return True


def _scope_matches(pattern: str, scope: Scope) -> bool:
    kind, _, ident = pattern.partition(":")
    return kind == scope.kind and ident in ("*", scope.id)


class _Mem0:
    """The adapter's state and its operations (shared by :class:`Memory` and
    :class:`AsyncMemory`)."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.views: dict[Scope, _ScopeView] = {}
        #: The last sequence this adapter wrote: reads wait for it (read-your-writes).
        self.last_seq: int | None = None
        #: The scope each memory id seen lives in, so calls by id find it.
        self.scope_of: dict[str, Scope] = {}

    def _ids(self, user_id: str | None, agent_id: str | None, run_id: str | None) -> tuple[Scope, dict[str, str]]:
        ids = {k: v for k, v in (("user_id", user_id), ("agent_id", agent_id), ("run_id", run_id)) if v}
        for key, kind in _ID_KINDS:
            if key in ids:
                return Scope.parse((kind, ids[key])), ids
        return Scope("agent", self.context.agent), ids

    def _wrote(self, seq: int | None) -> None:
        if seq is not None:
            self.last_seq = max(self.last_seq or 0, seq)

    def _refresh(self, scope: Scope) -> Op[_ScopeView]:
        view = self.views.setdefault(scope, _ScopeView())
        while True:
            page = yield from _ops.replay_page(self.context, scope=scope, after_seq=view.after_seq, limit=1000)
            for replayed in page["events"]:
                view.apply(replayed)
                self.scope_of[replayed["event"]["event_id"]] = scope
            if page["done"] or page["next_after"] <= view.after_seq:
                view.after_seq = max(view.after_seq, page["next_after"])
                return view
            view.after_seq = page["next_after"]

    def _find(self, memory_id: str) -> Op[tuple[Scope, _ScopeView]]:
        """The scope holding ``memory_id``: known, else each scope the key has events in."""
        scope = self.scope_of.get(memory_id)
        if scope is not None:
            view = yield from self._refresh(scope)
            if memory_id in view.mems:
                return scope, view
        for info in (yield from _ops.scopes(self.context)):
            # mem0 memories live in user, agent and session scopes, in the semantic or
            # procedural layer.
            layers = info.get("layers", {})
            if info["scope"]["kind"] not in _KINDS or not (layers.get("semantic") or layers.get("procedural")):
                continue
            candidate = Scope.parse((info["scope"]["kind"], info["scope"]["id"]))
            view = yield from self._refresh(candidate)
            if memory_id in view.mems:
                return candidate, view
        raise NotFound(f"memory {memory_id} not found in any scope this key reads", status=404)

    def add(
        self,
        messages: str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        infer: bool = True,
        memory_type: str | None = None,
        prompt: str | None = None,
    ) -> Op[dict[str, Any]]:
        """Stores each message (a text, or ``{"role", "content"}``; system messages are
        skipped) as a memory. Returns ``{"results": [{"id", "memory", "event": "ADD"}]}``."""
        del infer, prompt  # no LLM here: messages are stored as they are
        scope, ids = self._ids(user_id, agent_id, run_id)
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        elif isinstance(messages, Mapping):
            messages = [messages]
        events = []
        for message in messages:
            role, text = message.get("role"), str(message.get("content") or "").strip()
            if role == "system" or not text:
                continue
            events.append(self._event(scope, ids, text, role=role, metadata=metadata, memory_type=memory_type))
        if not events:
            return {"results": []}
        results = yield from _ops.append_batch(self.context, events)
        out = []
        for e, r in zip(events, results):
            error = r.get("error")
            if error:
                raise error_for(status_of(error["code"]), {"error": error})
            self._wrote(r["seq"])
            self.scope_of[r["event_id"]] = scope
            out.append({"id": r["event_id"], "memory": e["content"]["text"], "event": "ADD"})
        return {"results": out}

    def _event(
        self,
        scope: Scope,
        ids: Mapping[str, str],
        text: str,
        *,
        role: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        memory_type: str | None = None,
        supersedes: str | None = None,
    ) -> dict[str, Any]:
        tags = [TAG] + [f"mem0-{key.removesuffix('_id')}-{value}" for key, value in ids.items()]
        meta: dict[str, Any] = {"ids": dict(ids), "metadata": dict(metadata or {}), "role": role}
        if supersedes:
            meta["supersedes"] = supersedes
        layer = "procedural" if memory_type == "procedural_memory" else "semantic"
        return _ops.event(
            self.context, text, scope=scope, layer=layer, kind="observation",
            data={TAG: meta}, tags=tags, caused_by=supersedes,
        )

    def search(
        self,
        query: str,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        limit: int = 100,
        filters: Mapping[str, Any] | None = None,
        threshold: float | None = None,
        rerank: bool = True,
    ) -> Op[dict[str, Any]]:
        """Hybrid retrieval over the scope's mem0 memories:
        ``{"results": [{"id", "memory", "score", "metadata", ...}]}``, best first."""
        del rerank
        scope, ids = self._ids(user_id, agent_id, run_id)
        found = yield from _ops.retrieve(
            self.context, query, scope=scope, top_k=max(1, min(limit * 2, 1000)),
            filter={"tags": [TAG]}, min_seq=self.last_seq,
        )
        view = yield from self._refresh(scope)
        live = {m.id for m in view.live()}
        results = []
        for hit in found["results"]:
            mem = view.mems.get(hit["event_id"])
            if mem is None or mem.id not in live or not _matches(mem, ids, filters):
                continue
            if threshold is not None and hit["score"] < threshold:
                continue
            results.append(view.item(mem, hit["score"]))
            if len(results) >= limit:
                break
        return {"results": results}

    def get_all(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        limit: int = 100,
    ) -> Op[dict[str, Any]]:
        """The scope's current mem0 memories, oldest first: ``{"results": [...]}``."""
        scope, ids = self._ids(user_id, agent_id, run_id)
        view = yield from self._refresh(scope)
        mems = sorted((m for m in view.live() if _matches(m, ids, filters)), key=lambda m: m.seq)
        return {"results": [view.item(m) for m in mems[:limit]]}

    def get(self, memory_id: str) -> Op[dict[str, Any] | None]:
        """The memory (its current version, following updates), or None if it was deleted
        or never existed."""
        try:
            _, view = yield from self._find(memory_id)
        except NotFound:
            return None
        head = view.head(memory_id)
        if head in view.forgotten or head not in view.mems:
            return None
        return view.item(view.mems[head])

    def update(self, memory_id: str, data: str) -> Op[dict[str, Any]]:
        """Replaces the memory's text: a new memory superseding the current version."""
        scope, view = yield from self._find(memory_id)
        head = view.mems[view.head(memory_id)]
        if head.id in view.forgotten:
            raise NotFound(f"memory {memory_id} was deleted", status=404)
        new = self._event(scope, head.ids, data, role=head.role, metadata=head.metadata, supersedes=head.id)
        receipt = yield from _ops.append_event(self.context, new)
        self._wrote(receipt["seq"])
        self.scope_of[receipt["event_id"]] = scope
        forgotten = yield from _ops.forget(
            self.context, [head.id], reason=f"mem0: updated by {receipt['event_id']}", scope=scope, layer="semantic"
        )
        self._wrote(forgotten["seq"])
        return {"message": "Memory updated successfully!", "id": receipt["event_id"]}

    def delete(self, memory_id: str) -> Op[dict[str, Any]]:
        scope, view = yield from self._find(memory_id)
        head = view.head(memory_id)
        forgotten = yield from _ops.forget(self.context, [head], reason="mem0: deleted", scope=scope, layer="semantic")
        self._wrote(forgotten["seq"])
        return {"message": "Memory deleted successfully!"}

    def delete_all(
        self,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
    ) -> Op[dict[str, Any]]:
        """Forgets the mem0 memories of the scope the ids name, which must be one of the
        key's own (writable) scopes."""
        scope, ids = self._ids(user_id, agent_id, run_id)
        try:
            me = yield from _ops.whoami(self.context)
        except NotFound:
            # A gateway older than /v1/whoami: the server's own refusal of the `forgotten`
            # event on a scope the key may not write is the check (nothing is forgotten).
            me = {"tenant": self.context.tenant, "agent": self.context.agent, "scopes": [str(scope)], "grants": []}
        if me.get("tenant") != self.context.tenant or not any(_scope_matches(p, scope) for p in me.get("scopes", [])):
            raise Forbidden(
                f"delete_all touches only this key's own scopes ({', '.join(me.get('scopes', []))}); {scope} is not one",
                status=403,
            )
        view = yield from self._refresh(scope)
        doomed = [m.id for m in view.live() if _matches(m, ids, None)]
        for start in range(0, len(doomed), 1000):
            forgotten = yield from _ops.forget(
                self.context, doomed[start : start + 1000], reason="mem0: delete_all", scope=scope, layer="semantic"
            )
            self._wrote(forgotten["seq"])
        return {"message": "Memories deleted successfully!"}

    def history(self, memory_id: str) -> Op[list[dict[str, Any]]]:
        """Every change to the memory, oldest first, as mem0's history rows: ``event`` is
        ADD, UPDATE or DELETE, with ``old_memory`` and ``new_memory``."""
        _, view = yield from self._find(memory_id)
        rows: list[dict[str, Any]] = []
        previous: _Mem | None = None
        for mem in view.chain(memory_id):
            rows.append({
                "id": mem.id,
                "memory_id": mem.id,
                "old_memory": previous.text if previous else None,
                "new_memory": mem.text,
                "event": "UPDATE" if previous else "ADD",
                "created_at": mem.occurred_at,
                "updated_at": mem.occurred_at if previous else None,
                "is_deleted": False,
                "actor_id": mem.agent,
                "role": mem.role,
            })
            previous = mem
        if previous is not None and previous.id in view.forgotten and previous.id not in view.superseded_by:
            gone = view.forgotten[previous.id]
            rows.append({
                "id": gone.id,
                "memory_id": previous.id,
                "old_memory": previous.text,
                "new_memory": None,
                "event": "DELETE",
                "created_at": gone.at,
                "updated_at": gone.at,
                "is_deleted": True,
                "actor_id": None,
                "role": None,
            })
        return rows


class Memory:
    """mem0's ``Memory`` on Engram's HTTP API (blocking). See the module docs."""

    def __init__(
        self,
        client: Engram | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.client = client or Engram(url, api_key)
        self._core = _Mem0(self.client.context)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Memory:
        """``{"url": ..., "api_key": ...}`` (mem0's own config keys do not apply)."""
        return cls(url=config.get("url"), api_key=config.get("api_key"))

    def run(self, op: Op[Any]) -> Any:
        return self.client.run(op)

    add = bind_sync(_Mem0.add, "_core")
    search = bind_sync(_Mem0.search, "_core")
    get_all = bind_sync(_Mem0.get_all, "_core")
    get = bind_sync(_Mem0.get, "_core")
    update = bind_sync(_Mem0.update, "_core")
    delete = bind_sync(_Mem0.delete, "_core")
    delete_all = bind_sync(_Mem0.delete_all, "_core")
    history = bind_sync(_Mem0.history, "_core")


class AsyncMemory:
    """mem0's ``AsyncMemory`` on :class:`~engram_client.AsyncEngram`."""

    def __init__(self, client: AsyncEngram) -> None:
        self.client = client
        self._core = _Mem0(client.context)

    async def run(self, op: Op[Any]) -> Any:
        return await self.client.run(op)

    add = bind_async(_Mem0.add, "_core")
    search = bind_async(_Mem0.search, "_core")
    get_all = bind_async(_Mem0.get_all, "_core")
    get = bind_async(_Mem0.get, "_core")
    update = bind_async(_Mem0.update, "_core")
    delete = bind_async(_Mem0.delete, "_core")
    delete_all = bind_async(_Mem0.delete_all, "_core")
    history = bind_async(_Mem0.history, "_core")
