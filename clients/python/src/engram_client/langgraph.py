"""A LangGraph ``BaseStore`` on Engram: ``EngramStore`` (``batch`` and ``abatch`` over
``GetOp``, ``PutOp``, ``SearchOp`` and ``ListNamespacesOp``).

**Mapping.** A store lives in one Engram scope, ``scope=`` (default: the key's own
``agent:<agent>``; a team shares one with ``scope="team:core"`` and keys that may write
it). LangGraph namespaces are tuples *within* that scope: ``("users", "alice",
"prefs")`` is a namespace of the store, not an Engram scope, so ``search`` and
``list_namespaces`` over any prefix read one scope and are complete.

**Items are events.** Each put of ``(namespace, key)`` appends a semantic ``observation``
tagged ``langgraph`` whose data holds the namespace, key and value, and whose text is the
value's indexed fields (``index``: the store's ``index_fields``, ``["$"]`` = every string
in the value, or the put's own ``index=[...]``; ``index=False`` appends no text, so the item
is not retrievable by query). It then forgets the version it replaced; a delete forgets the
current version. The store's state is the replay of the scope's ``langgraph`` events in
stream order (the last put wins), kept per store instance and caught up incrementally on
each batch (``/v1/replay`` after the last sequence seen), so a value written by any
instance is read back exactly, never expires, and a scope holds any number of items.
Working memory was not used: it expires (1 h by default) and lists at most 64 entries.

**Search.** Without ``query``: the items under ``namespace_prefix`` that pass ``filter``
(equality, or ``$eq $ne $gt $gte $lt $lte`` on top-level or dotted fields), oldest first.
With ``query``: Engram's hybrid retrieval over the indexed items (read-your-writes on the
store's own last append), best first, with ``score``.

Within one batch, gets, searches and listings see the state before the batch's puts, as
in LangGraph's ``InMemoryStore``; several puts of one key in a batch keep the last. TTLs
are not supported (``supports_ttl = False``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
)

from . import _ops
from ._core import Context, Scope, ScopeLike
from ._core import Op as EngramOp
from .client import AsyncEngram, Engram
from .errors import error_for, status_of

__all__ = ["EngramStore"]

TAG = "langgraph"
#: Forgotten events of the consolidator (merged near-duplicates, archived memories) take
#: memories out of retrieval; they do not delete store items.
_CONSOLIDATOR = "consolidator"


def _time(value: str) -> datetime:
    # RFC 3339 with nanoseconds: Python keeps microseconds.
    value = value.replace("Z", "+00:00")
    if "." in value:
        head, rest = value.split(".", 1)
        digits = rest[: len(rest) - len(rest.lstrip("0123456789"))]
        zone = rest[len(digits) :]
        value = f"{head}.{digits[:6].ljust(6, '0')}{zone}"
    return datetime.fromisoformat(value)


@dataclass
class _Version:
    event_id: str
    seq: int
    value: dict[str, Any]
    created_at: str
    updated_at: str


@dataclass
class _State:
    after_seq: int = 0
    items: dict[tuple[tuple[str, ...], str], _Version] = field(default_factory=dict)
    by_event: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)

    def apply(self, replayed: Mapping[str, Any]) -> None:
        seq, e = replayed["seq"], replayed["event"]
        self.after_seq = max(self.after_seq, seq)
        data = (e.get("content") or {}).get("data") or {}
        if e.get("kind") == "forgotten":
            if e.get("agent_id") == _CONSOLIDATOR:
                return
            for event_id in data.get("event_ids", []):
                where = self.by_event.pop(event_id, None)
                if where is not None and self.items.get(where, None) is not None:
                    if self.items[where].event_id == event_id:
                        del self.items[where]
            return
        meta = data.get(TAG)
        if TAG not in (e.get("tags") or []) or not isinstance(meta, Mapping):
            return
        where = (tuple(meta["namespace"]), str(meta["key"]))
        previous = self.items.get(where)
        self.items[where] = _Version(
            event_id=e["event_id"],
            seq=seq,
            value=dict(meta.get("value") or {}),
            created_at=previous.created_at if previous else e["occurred_at"],
            updated_at=e["occurred_at"],
        )
        self.by_event[e["event_id"]] = where

    def item(self, where: tuple[tuple[str, ...], str]) -> Item | None:
        version = self.items.get(where)
        if version is None:
            return None
        return Item(
            value=version.value, key=where[1], namespace=where[0],
            created_at=_time(version.created_at), updated_at=_time(version.updated_at),
        )


def _path(value: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _compare(op: str, have: Any, target: Any) -> bool:
    try:
        if op == "$eq":
            return bool(have == target)
        if op == "$ne":
            return bool(have != target)
        if have is None:
            return False
        if op == "$gt":
            return bool(have > target)
        if op == "$gte":
            return bool(have >= target)
        if op == "$lt":
            return bool(have < target)
        if op == "$lte":
            return bool(have <= target)
    except TypeError:
        return False
    raise ValueError(f"filter operator {op!r}: use $eq $ne $gt $gte $lt $lte")


def _passes(value: Mapping[str, Any], filter: Mapping[str, Any] | None) -> bool:
    for path, want in (filter or {}).items():
        have = _path(value, path)
        conditions = want.items() if isinstance(want, Mapping) and all(str(k).startswith("$") for k in want) else [("$eq", want)]
        for op, target in conditions:
            if not _compare(op, have, target):
                return False
    return True


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [str(value)]
    return []


def _text(value: Mapping[str, Any], fields: Sequence[str]) -> str:
    parts: list[str] = []
    for f in fields:
        parts.extend(_strings(value if f == "$" else _path(value, f)))
    return "\n".join(p for p in parts if p.strip())[: 256 * 1024]


def _namespace_matches(namespace: tuple[str, ...], op: ListNamespacesOp) -> bool:
    for condition in op.match_conditions or ():
        path = tuple(condition.path)
        if len(path) > len(namespace):
            return False
        part = namespace[: len(path)] if condition.match_type == "prefix" else namespace[len(namespace) - len(path) :]
        if any(p != "*" and p != n for p, n in zip(path, part)):
            return False
    return True


class _StoreCore:
    """The store's state and its one implementation of a batch."""

    def __init__(self, context: Context, scope: Scope, index_fields: Sequence[str]) -> None:
        self.context = context
        self.scope = scope
        self.index_fields = list(index_fields)
        self.state = _State()
        self.last_seq: int | None = None

    def _refresh(self) -> EngramOp[_State]:
        state = self.state
        while True:
            page = yield from _ops.replay_page(self.context, scope=self.scope, after_seq=state.after_seq, limit=1000)
            for replayed in page["events"]:
                state.apply(replayed)
            state.after_seq = max(state.after_seq, page["next_after"])
            if page["done"] or not page["events"]:
                return state

    def batch(self, ops: Iterable[Op]) -> EngramOp[list[Result]]:
        ops = list(ops)
        state = yield from self._refresh()
        results: list[Result] = [None] * len(ops)
        puts: dict[tuple[tuple[str, ...], str], PutOp] = {}
        for i, op in enumerate(ops):
            if isinstance(op, GetOp):
                results[i] = state.item((tuple(op.namespace), op.key))
            elif isinstance(op, SearchOp):
                results[i] = yield from self._search(op)
            elif isinstance(op, ListNamespacesOp):
                results[i] = self._list_namespaces(op)
            elif isinstance(op, PutOp):
                puts[(tuple(op.namespace), op.key)] = op
            else:
                raise ValueError(f"unknown store operation {op!r}")
        if puts:
            yield from self._put(list(puts.values()))
        return results

    def _search(self, op: SearchOp) -> EngramOp[list[SearchItem]]:
        prefix = tuple(op.namespace_prefix)
        state = self.state

        def wanted(where: tuple[tuple[str, ...], str]) -> bool:
            version = state.items.get(where)
            return version is not None and where[0][: len(prefix)] == prefix and _passes(version.value, op.filter)

        def search_item(where: tuple[tuple[str, ...], str], score: float | None) -> SearchItem:
            version = state.items[where]
            return SearchItem(
                namespace=where[0], key=where[1], value=version.value,
                created_at=_time(version.created_at), updated_at=_time(version.updated_at), score=score,
            )

        if not op.query:
            ordered = sorted((w for w in state.items if wanted(w)), key=lambda w: state.items[w].seq)
            return [search_item(w, None) for w in ordered[op.offset : op.offset + op.limit]]
        found = yield from _ops.retrieve(
            self.context, op.query, scope=self.scope, top_k=min(1000, max(10, (op.offset + op.limit) * 4)),
            filter={"tags": [TAG]}, min_seq=self.last_seq,
        )
        hits: list[SearchItem] = []
        for hit in found["results"]:
            where = state.by_event.get(hit["event_id"])
            if where is None or state.items[where].event_id != hit["event_id"] or not wanted(where):
                continue
            hits.append(search_item(where, float(hit["score"])))
        return hits[op.offset : op.offset + op.limit]

    def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        namespaces = {ns for ns, _ in self.state.items if _namespace_matches(ns, op)}
        if op.max_depth is not None:
            namespaces = {ns[: op.max_depth] for ns in namespaces}
        return sorted(namespaces)[op.offset : op.offset + op.limit]

    def _put(self, puts: list[PutOp]) -> EngramOp[None]:
        state = self.state
        replaced = [state.items[(tuple(p.namespace), p.key)].event_id for p in puts if (tuple(p.namespace), p.key) in state.items]
        events = []
        for p in puts:
            if p.value is None:
                continue
            fields = self.index_fields if p.index is None else (p.index or [])
            value = dict(p.value)
            events.append(_ops.event(
                self.context, _text(value, fields), scope=self.scope, layer="semantic", kind="observation",
                tags=[TAG], importance=1.0,
                data={TAG: {"namespace": list(p.namespace), "key": p.key, "value": value}},
            ))
        if events:
            results = yield from _ops.append_batch(self.context, events)
            for r in results:
                error = r.get("error")
                if error:
                    raise error_for(status_of(error["code"]), {"error": error})
                self.last_seq = max(self.last_seq or 0, r["seq"] or 0)
        if replaced:
            for start in range(0, len(replaced), 1000):
                forgotten = yield from _ops.forget(
                    self.context, replaced[start : start + 1000], reason="langgraph: replaced or deleted",
                    scope=self.scope, layer="semantic",
                )
                self.last_seq = max(self.last_seq or 0, forgotten["seq"])
        # What this batch wrote is read back by the next one's catch-up, in stream order.
        return None


class EngramStore(BaseStore):
    """LangGraph's ``BaseStore`` on Engram (see the module docs for the mapping).

    ``client`` serves ``batch`` and ``aclient`` serves ``abatch``; with only one of them,
    the other kind of call runs through it (``abatch`` in a worker thread).
    """

    supports_ttl = False

    def __init__(
        self,
        client: Engram | None = None,
        *,
        aclient: AsyncEngram | None = None,
        scope: ScopeLike | None = None,
        index_fields: Sequence[str] = ("$",),
    ) -> None:
        if client is None and aclient is None:
            raise ValueError("give an Engram client, an AsyncEngram one, or both")
        self.client = client
        self.aclient = aclient
        context = (client or aclient).context  # type: ignore[union-attr]
        self._core = _StoreCore(
            context, Scope.parse(scope) if scope is not None else Scope("agent", context.agent), index_fields
        )
        self._lock = asyncio.Lock()

    @property
    def scope(self) -> Scope:
        return self._core.scope

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        if self.client is None:
            raise RuntimeError("this EngramStore has only an async client: use the a* methods")
        return self.client.run(self._core.batch(ops))

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        if self.aclient is None:
            return await asyncio.to_thread(self.batch, list(ops))
        async with self._lock:
            return await self.aclient.run(self._core.batch(ops))
