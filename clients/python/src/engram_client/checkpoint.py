"""A LangGraph checkpointer on Engram: ``EngramSaver``, a ``BaseCheckpointSaver`` (sync
and async) whose checkpoints and pending writes are events of the thread's scope.

**Mapping.** A thread lives in the scope ``session:<thread_id>`` when the thread id is a
valid scope id (1-64 of ``A-Z a-z 0-9 _ -``), else in ``session:t-<sha256(thread_id)[:40]>``
(:func:`thread_scope`); ``scope=`` puts every thread in one scope instead (``task:build-42``,
``team:core``). The events carry the real ``thread_id`` and ``checkpoint_ns``, and every read
filters on them, so nothing relies on the mapping being reversible or collision-free. A key
may write every ``session:*`` and ``task:*`` scope of its tenant by default.

**Events.** Everything the saver writes is a ``checkpoint`` event on the ``episodic`` layer,
tagged ``langgraph-checkpoint`` and ``langgraph-checkpoint:<type>``, with an empty text and
``data = {"langgraph_checkpoint": 1, "type", "body", "payloads"}``:

- ``checkpoint``: one ``put``: the checkpoint without its channel values, its metadata, and
  a blob for each channel in ``new_versions`` (the others are read from the versions earlier
  checkpoints wrote, as LangGraph's own savers do, so a step stores what it changed only).
- ``writes``: one ``put_writes`` (the task's pending writes for a checkpoint).
- ``chunk``: a slice of a payload too large for one event (below).
- ``delete_thread``: a tombstone: the thread's events before it no longer exist.
- ``drop``: checkpoints (and their writes) removed by ``prune`` or ``delete_for_runs``.

``body`` is the hex of a UTF-8 JSON object (thread id, namespace, ids, parent, run id, blob
channels and versions, the serializer's type of each payload); each payload is the hex of
``self.serde.dumps_typed(...)`` bytes. Hex, not JSON strings or base64, because the gateway
scrubs secrets from every string of an event: a subgraph namespace such as
``fetch_api_key:<uuid>`` reads as a key and a value, and base64 can spell a Google API key;
hex (``0-9a-f``) can spell none of the names or prefixes the scrubber looks for, so what is
read back is exactly what was written. The text stays empty so that checkpoints are no
text memories: retrieval, consolidation (merges, summaries, decay) and the context builder
never see them. The layer is episodic rather than working: a checkpoint is a durable record
of what a run did (LangGraph reads old ones for time travel and forks), and working memory
is the scope's expiring scratch space. The data never has a top-level ``finished``, the key
by which a ``checkpoint`` event marks a session as finished for the consolidator.

**Chunking.** An event is at most 512 KiB and a request at most 1 MiB. When an event's data
would exceed :data:`MAX_EVENT_DATA`, its largest payloads are cut into ``chunk`` events of
:data:`CHUNK_BYTES` and replaced by ``{"ref", "count", "size", "sha256"}``. Chunks are
appended first (in requests of at most :data:`MAX_REQUEST`); the event that refers to them
goes in a request of its own once they are stored, so a reader that sees it has seen them.
A checkpoint of any size is stored; only a body (ids, channel names) past one event is
refused, with :class:`~engram_client.errors.TooLarge` naming the size and the limit.

**Reading.** The saver's state is the replay of each scope it reads (``/v1/replay``), kept
per instance and caught up incrementally (after the last sequence seen) before every read,
so a checkpoint written by any instance, on any machine, is read back exactly. ``get_tuple``
without a ``checkpoint_id`` gives the thread's greatest checkpoint id in the namespace (ids
are time-ordered UUIDs, as in LangGraph's own savers); ``list`` gives them newest first.
Every event read back is checked: one whose data is malformed (or a payload whose chunks do
not add up to its size and SHA-256) is skipped with a warning on the
``engram_client.checkpoint`` logger, never raised. Listing every thread (``list(None)``) and
``delete_for_runs`` read every ``session`` scope of the tenant the key can read (or the one
``scope=``), skipping the ones whose event count has not changed since they were read.

**Concurrency.** Every instance applies the same events in the same (stream) order, so
they agree: a ``put`` of a new checkpoint id never conflicts with another; a ``put`` of an
existing id replaces it (the last one wins); a pending write is kept once per
``(task_id, idx)`` (the first wins, but the special ``__error__``/``__interrupt__`` writes,
which replace); a blob is kept once per ``(namespace, channel, version)`` (the first wins),
and versions carry a random fraction (as ``InMemorySaver``'s do), so forks never collide.
Deletions apply to what precedes them in the stream; ``prune`` and ``delete_for_runs`` name
the checkpoints they drop, so they never drop one the deleting instance had not seen.
LangGraph itself runs one run per thread at a time; the saver adds no lock of its own.

**Deleting.** The log is append-only: ``delete_thread``, ``prune`` and ``delete_for_runs``
append events that hide what they delete from every saver; the events stay in the stream
until an admin erases the scope (``engram erase --tenant T --scope session:<id>``) or
retention removes them. For the same reason, a thread needs the stream to keep its events
(no ``max_age`` shorter than the thread's life): a checkpoint reads the blobs of unchanged
channels from the events that first wrote them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence, Union

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from . import _ops
from ._core import _IDENT, Context, Request, Scope, ScopeLike, call, uuid7
from ._core import Op as EngramOp
from .client import AsyncEngram, Engram
from .errors import TooLarge, error_for, status_of

__all__ = ["EngramSaver", "thread_scope", "TAG", "MAX_EVENT_DATA", "CHUNK_BYTES", "MAX_REQUEST"]

logger = logging.getLogger(__name__)

TAG = "langgraph-checkpoint"
#: The key of ``data`` that marks the saver's events, and the format's version.
MARKER = "langgraph_checkpoint"
FORMAT = 1
KIND = "checkpoint"
LAYER = "episodic"
#: Most characters of one event's JSON ``data``: room under the server's 512 KiB per event
#: for the envelope and the MessagePack framing.
MAX_EVENT_DATA = 384 * 1024
#: Bytes of a payload per ``chunk`` event (twice as many hex characters).
CHUNK_BYTES = 160 * 1024
#: Most characters of events per append request (the gateway takes 1 MiB bodies).
MAX_REQUEST = 768 * 1024
#: Most checkpoints one ``drop`` event names, and most writes one copied ``writes`` event holds.
_MAX_DROPS = 500
_MAX_WRITES = 256
#: ``/v1/scopes`` lists at most this many scopes.
_MAX_SCOPES = 10_000

_TYPES = ("checkpoint", "writes", "chunk", "delete_thread", "drop")


def thread_scope(thread_id: str) -> Scope:
    """The scope a thread lives in when the saver is given no ``scope=``:
    ``session:<thread_id>`` if the thread id is a valid scope id, else
    ``session:t-<first 40 hex digits of its SHA-256>``."""
    if _IDENT.fullmatch(thread_id):
        return Scope("session", thread_id)
    return Scope("session", "t-" + hashlib.sha256(thread_id.encode("utf-8")).hexdigest()[:40])


# --- What events hold -------------------------------------------------------------------


class _Malformed(Exception):
    """An event of the saver's that cannot be read: skipped, with a warning."""


class _Broken(Exception):
    """A stored checkpoint that cannot be put together (a chunk missing or altered)."""


@dataclass(frozen=True)
class _Ref:
    """A payload stored as ``count`` chunk events."""

    ref: str
    count: int
    size: int
    sha256: str


Payload = Union[bytes, _Ref]
#: The serializer's type name and the payload (``serde.loads_typed`` takes ``(type, bytes)``).
Typed = tuple[str, Payload]
Version = Union[str, int, float]


@dataclass
class _Saved:
    seq: int
    parent: str | None
    run_id: str | None
    checkpoint: Typed
    metadata: Typed


@dataclass
class _Write:
    task_id: str
    task_path: str
    idx: int
    channel: str
    value: Typed


@dataclass
class _Thread:
    #: (checkpoint_ns, checkpoint_id) -> the checkpoint.
    checkpoints: dict[tuple[str, str], _Saved] = field(default_factory=dict)
    #: (checkpoint_ns, checkpoint_id) -> (task_id, idx) -> the write.
    writes: dict[tuple[str, str], dict[tuple[str, int], _Write]] = field(default_factory=dict)
    #: (checkpoint_ns, channel, version) -> the channel's value at that version.
    blobs: dict[tuple[str, str, Version], Typed] = field(default_factory=dict)

    def refs(self) -> Iterator[str]:
        for saved in self.checkpoints.values():
            yield from _refs_of(saved.checkpoint, saved.metadata)
        for writes in self.writes.values():
            for w in writes.values():
                yield from _refs_of(w.value)
        yield from _refs_of(*self.blobs.values())


def _refs_of(*typed: Typed) -> Iterator[str]:
    for _, payload in typed:
        if isinstance(payload, _Ref):
            yield payload.ref


def _hex_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8").hex()


def _str(body: Mapping[str, Any], key: str, *, optional: bool = False) -> Any:
    value = body.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _Malformed(f"{key} is not a string")
    return value


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Malformed(f"{what} is not an integer")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Malformed(f"{what} is not a list")
    return value


def _version(value: Any) -> Version:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _Malformed(f"channel version {value!r} is not a string or a number")
    return value


def _payload(value: Any) -> Payload:
    if isinstance(value, str):
        try:
            return bytes.fromhex(value)
        except ValueError:
            raise _Malformed("a payload is not hex") from None
    if isinstance(value, Mapping):
        ref, sha = value.get("ref"), value.get("sha256")
        count, size = _int(value.get("count"), "a chunked payload's count"), _int(value.get("size"), "its size")
        if not isinstance(ref, str) or not ref or not isinstance(sha, str) or len(sha) != 64:
            raise _Malformed("a chunked payload has no ref or no sha256")
        if count < 1 or size < 0:
            raise _Malformed("a chunked payload has a count below 1 or a negative size")
        return _Ref(ref, count, size, sha.lower())
    raise _Malformed("a payload is neither hex nor a chunk reference")


def _body(data: Mapping[str, Any]) -> dict[str, Any]:
    raw = data.get("body")
    if not isinstance(raw, str):
        raise _Malformed("no body")
    try:
        body = json.loads(bytes.fromhex(raw).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise _Malformed("the body is not hex of UTF-8 JSON") from None
    if not isinstance(body, dict):
        raise _Malformed("the body is not a JSON object")
    return body


def _typed(body: Mapping[str, Any], data: Mapping[str, Any], count: int) -> list[Typed]:
    types = _list(body.get("types"), "types")
    payloads = _list(data.get("payloads"), "payloads")
    if len(types) != count or len(payloads) != count:
        raise _Malformed(f"{len(types)} types and {len(payloads)} payloads for {count} values")
    if not all(isinstance(t, str) for t in types):
        raise _Malformed("a type is not a string")
    return [(t, _payload(p)) for t, p in zip(types, payloads)]


@dataclass
class _Scope:
    """What one scope's events say, as far as they were read."""

    after_seq: int = 0
    #: Events read (all of the scope's, ours or not): compared with /v1/scopes' count.
    events: int = 0
    threads: dict[str, _Thread] = field(default_factory=dict)
    #: ref -> index -> bytes.
    chunks: dict[str, dict[int, bytes]] = field(default_factory=dict)

    def apply(self, scope: Scope, seq: int, replayed: Mapping[str, Any]) -> None:
        e = replayed.get("event")
        if not isinstance(e, Mapping) or e.get("kind") != KIND:
            return
        content = e.get("content")
        data = content.get("data") if isinstance(content, Mapping) else None
        tags = e.get("tags")
        tagged = isinstance(tags, list) and TAG in tags
        if not tagged and not (isinstance(data, Mapping) and MARKER in data):
            # Another writer's checkpoint event (a session's end, say): not ours.
            return
        try:
            if not isinstance(data, Mapping):
                raise _Malformed("its data is not an object")
            version = data.get(MARKER)
            if version != FORMAT:
                raise _Malformed(f"format {version!r}, this saver reads {FORMAT}")
            self._apply(seq, data)
        except _Malformed as why:
            logger.warning(
                "EngramSaver: skipping event %s (seq %s) of %s: %s",
                e.get("event_id"), seq, scope, why,
            )

    def _apply(self, seq: int, data: Mapping[str, Any]) -> None:
        kind = data.get("type")
        if kind == "chunk":
            ref, hexed = data.get("ref"), data.get("hex")
            index, count = _int(data.get("index"), "index"), _int(data.get("count"), "count")
            if not isinstance(ref, str) or not ref or not isinstance(hexed, str) or not 0 <= index < count:
                raise _Malformed("a chunk without ref, hex, or an index within its count")
            try:
                piece = bytes.fromhex(hexed)
            except ValueError:
                raise _Malformed("a chunk is not hex") from None
            self.chunks.setdefault(ref, {}).setdefault(index, piece)
            return
        if kind not in _TYPES:
            raise _Malformed(f"unknown type {kind!r}")
        body = _body(data)
        thread_id = _str(body, "thread_id")
        if kind == "delete_thread":
            gone = self.threads.pop(thread_id, None)
            if gone is not None:
                self._forget_chunks(gone.refs())
            return
        if kind == "drop":
            pairs: list[tuple[str, str]] = []
            for p in _list(body.get("checkpoints"), "checkpoints"):
                if not isinstance(p, list) or len(p) != 2 or not all(isinstance(x, str) for x in p):
                    raise _Malformed("a dropped checkpoint is not [checkpoint_ns, checkpoint_id]")
                pairs.append((p[0], p[1]))
            thread = self.threads.get(thread_id)
            if thread is not None:
                for key in pairs:
                    saved = thread.checkpoints.pop(key, None)
                    writes = thread.writes.pop(key, {})
                    dropped = [saved.checkpoint, saved.metadata] if saved else []
                    dropped += [w.value for w in writes.values()]
                    # Blobs stay: later checkpoints may read unchanged channels from them.
                    self._forget_chunks(_refs_of(*dropped))
            return
        ns = _str(body, "checkpoint_ns")
        checkpoint_id = _str(body, "checkpoint_id")
        if kind == "checkpoint":
            blobs = _list(body.get("blobs"), "blobs")
            keys: list[tuple[str, Version]] = []
            for b in blobs:
                if not isinstance(b, list) or len(b) != 2 or not isinstance(b[0], str):
                    raise _Malformed("a blob is not [channel, version]")
                keys.append((b[0], _version(b[1])))
            typed = _typed(body, data, 2 + len(keys))
            parent = _str(body, "parent_checkpoint_id", optional=True)
            run_id = _str(body, "run_id", optional=True)
            thread = self.threads.setdefault(thread_id, _Thread())
            thread.checkpoints[(ns, checkpoint_id)] = _Saved(seq, parent, run_id, typed[0], typed[1])
            for (channel, version), value in zip(keys, typed[2:]):
                thread.blobs.setdefault((ns, channel, version), value)
            return
        # writes
        entries = _list(body.get("writes"), "writes")
        parsed: list[tuple[str, str, int, str]] = []
        for w in entries:
            if not isinstance(w, list) or len(w) != 4:
                raise _Malformed("a write is not [task_id, task_path, idx, channel]")
            task_id, task_path, idx, channel = w
            if not isinstance(task_id, str) or not isinstance(task_path, str) or not isinstance(channel, str):
                raise _Malformed("a write's task_id, task_path or channel is not a string")
            parsed.append((task_id, task_path, _int(idx, "a write's idx"), channel))
        values = _typed(body, data, len(parsed))
        thread = self.threads.setdefault(thread_id, _Thread())
        stored = thread.writes.setdefault((ns, checkpoint_id), {})
        for (task_id, task_path, idx, channel), value in zip(parsed, values):
            # As LangGraph's savers: a regular write is kept once (a retried task writes the
            # same), a special one (error, interrupt, ...) is replaced by the latest.
            if idx >= 0 and (task_id, idx) in stored:
                continue
            stored[(task_id, idx)] = _Write(task_id, task_path, idx, channel, value)

    def _forget_chunks(self, refs: Iterable[str]) -> None:
        for ref in refs:
            self.chunks.pop(ref, None)

    def resolve(self, payload: Payload) -> bytes:
        if isinstance(payload, bytes):
            return payload
        pieces = self.chunks.get(payload.ref, {})
        missing = [i for i in range(payload.count) if i not in pieces]
        if missing:
            raise _Broken(f"chunk {missing[0]} of {payload.count} of payload {payload.ref} is missing")
        raw = b"".join(pieces[i] for i in range(payload.count))
        if len(raw) != payload.size or hashlib.sha256(raw).hexdigest() != payload.sha256:
            raise _Broken(f"payload {payload.ref} does not match its size and SHA-256")
        return raw


# --- Writing -------------------------------------------------------------------------------


@dataclass
class _Unit:
    """One event to append, after the chunk events it refers to."""

    event: dict[str, Any]
    size: int
    chunks: list[tuple[dict[str, Any], int]] = field(default_factory=list)


def _config(thread_id: str, ns: str, checkpoint_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}}


def _sort_key(w: _Write) -> tuple[str, str, int]:
    # langgraph.checkpoint.base.writes_sort_key: the order a super-step applies its writes.
    return (w.task_path, w.task_id, w.idx)


@dataclass
class _Gathered:
    """One checkpoint's stored bytes, read out of the state under the lock."""

    thread_id: str
    ns: str
    checkpoint_id: str
    parent: str | None
    checkpoint: Any
    metadata: tuple[str, bytes]
    blobs: dict[str, tuple[str, bytes]]
    writes: list[tuple[str, str, tuple[str, bytes]]]


class _SaverCore:
    """The saver's state and its one implementation of each operation, as I/O-free
    operations (``engram_client._core``) that the sync and async methods run."""

    def __init__(self, context: Context, scope: Scope | None) -> None:
        self.context = context
        self.scope = scope
        self.states: dict[Scope, _Scope] = {}
        # Held only between requests, never across one, so sync calls (from LangGraph's
        # worker threads) and async ones may share the saver.
        self.lock = threading.RLock()

    def scope_of(self, thread_id: str) -> Scope:
        return self.scope if self.scope is not None else thread_scope(thread_id)

    def state(self, scope: Scope) -> _Scope:
        with self.lock:
            return self.states.setdefault(scope, _Scope())

    # Reading.

    def refresh(self, scope: Scope) -> EngramOp[_Scope]:
        """Catches the scope's state up with the stream."""
        state = self.state(scope)
        while True:
            after = state.after_seq
            page = yield from _ops.replay_page(self.context, scope=scope, after_seq=after, limit=1000)
            events = page.get("events") if isinstance(page, Mapping) else None
            if not isinstance(events, list):
                raise error_for(500, f"/v1/replay of {scope} answered without events")
            with self.lock:
                for replayed in events:
                    seq = replayed.get("seq") if isinstance(replayed, Mapping) else None
                    if not isinstance(seq, int) or isinstance(seq, bool):
                        logger.warning("EngramSaver: skipping a replayed item of %s without a seq", scope)
                        continue
                    if seq <= state.after_seq:
                        continue  # another call caught up past it meanwhile
                    state.apply(scope, seq, replayed)
                    state.after_seq = seq
                    state.events += 1
                next_after = page.get("next_after")
                if isinstance(next_after, int) and not isinstance(next_after, bool):
                    state.after_seq = max(state.after_seq, next_after)
            # Done, or (an answer that does not say how far it read) no further on.
            if page.get("done") is not False or state.after_seq <= after:
                return state

    def every_scope(self) -> EngramOp[list[Scope]]:
        """The scopes threads may live in, each caught up: ``scope=``, or every readable
        ``session`` scope of the tenant (read again only if its event count changed)."""
        if self.scope is not None:
            yield from self.refresh(self.scope)
            return [self.scope]
        body = yield from call(Request("POST", "/v1/scopes", {"tenant": self.context.tenant, "limit": _MAX_SCOPES}))
        if isinstance(body, Mapping) and body.get("truncated"):
            logger.warning("EngramSaver: /v1/scopes listed only %s scopes; threads beyond them are not read", _MAX_SCOPES)
        counts: dict[Scope, int] = {}
        for info in (body.get("scopes") if isinstance(body, Mapping) else None) or []:
            try:
                scope = Scope.parse(info["scope"])
                count = int(info.get("events", 0))
            except (KeyError, TypeError, ValueError):
                continue
            if scope.kind == "session":
                counts[scope] = count
        with self.lock:
            # Scopes read before that the list left out (truncated): read them too. Not the
            # empty ones that looking up a thread that does not exist leaves behind.
            known = {s for s, state in self.states.items() if s.kind == "session" and state.events}
        scopes = sorted(set(counts) | known)
        for scope in scopes:
            if self.state(scope).events != counts.get(scope, -1):
                yield from self.refresh(scope)
        return scopes

    def candidates(
        self, config: RunnableConfig | None, before: RunnableConfig | None
    ) -> EngramOp[list[tuple[Scope, str, str, str]]]:
        """The checkpoints a ``list`` may yield (before its metadata filter), newest first."""
        configurable = (config or {}).get("configurable") or {}
        thread = configurable.get("thread_id")
        if thread is not None:
            thread = str(thread)
            scope = self.scope_of(thread)
            yield from self.refresh(scope)
            scopes = [scope]
        else:
            scopes = yield from self.every_scope()
        ns = configurable.get("checkpoint_ns") if config else None
        exact = configurable.get("checkpoint_id")
        before_id = ((before or {}).get("configurable") or {}).get("checkpoint_id")
        found: list[tuple[Scope, str, str, str]] = []
        with self.lock:
            for scope in scopes:
                for thread_id, t in self.state(scope).threads.items():
                    if thread is not None and thread_id != thread:
                        continue
                    for cns, cid in t.checkpoints:
                        if ns is not None and cns != ns:
                            continue
                        if exact and cid != exact:
                            continue
                        if before_id and cid >= before_id:
                            continue
                        found.append((scope, thread_id, cns, cid))
        found.sort(key=lambda f: (f[3], f[1], f[2]), reverse=True)
        return found

    def gather(self, serde: SerializerProtocol, scope: Scope, thread_id: str, ns: str, checkpoint_id: str) -> _Gathered | None:
        """One checkpoint's bytes (None: gone), or ``_Broken``."""
        with self.lock:
            state = self.state(scope)
            thread = state.threads.get(thread_id)
            saved = thread.checkpoints.get((ns, checkpoint_id)) if thread else None
            if thread is None or saved is None:
                return None
            checkpoint = serde.loads_typed((saved.checkpoint[0], state.resolve(saved.checkpoint[1])))
            metadata = (saved.metadata[0], state.resolve(saved.metadata[1]))
            blobs: dict[str, tuple[str, bytes]] = {}
            for channel, version in (checkpoint.get("channel_versions") or {}).items():
                blob = thread.blobs.get((ns, channel, version))
                if blob is not None and blob[0] != "empty":
                    blobs[channel] = (blob[0], state.resolve(blob[1]))
            ordered = sorted((thread.writes.get((ns, checkpoint_id)) or {}).values(), key=_sort_key)
            writes = [(w.task_id, w.channel, (w.value[0], state.resolve(w.value[1]))) for w in ordered]
            return _Gathered(thread_id, ns, checkpoint_id, saved.parent, checkpoint, metadata, blobs, writes)

    def checkpoint_tuple(self, serde: SerializerProtocol, scope: Scope, thread_id: str, ns: str, checkpoint_id: str) -> CheckpointTuple | None:
        try:
            g = self.gather(serde, scope, thread_id, ns, checkpoint_id)
        except _Broken as why:
            logger.warning("EngramSaver: skipping checkpoint %s of thread %r in %s: %s", checkpoint_id, thread_id, scope, why)
            return None
        if g is None:
            return None
        checkpoint = dict(g.checkpoint)
        checkpoint["channel_values"] = {ch: serde.loads_typed(v) for ch, v in g.blobs.items()}
        return CheckpointTuple(
            config=_config(thread_id, ns, checkpoint_id),
            checkpoint=checkpoint,  # type: ignore[arg-type]
            metadata=serde.loads_typed(g.metadata),
            parent_config=_config(thread_id, ns, g.parent) if g.parent else None,
            pending_writes=[(task, ch, serde.loads_typed(v)) for task, ch, v in g.writes],
        )

    def tuples(
        self,
        serde: SerializerProtocol,
        found: list[tuple[Scope, str, str, str]],
        filter: Mapping[str, Any] | None,
        limit: int | None,
    ) -> Iterator[CheckpointTuple]:
        left = limit
        for scope, thread_id, ns, checkpoint_id in found:
            if left is not None and left <= 0:
                return
            t = self.checkpoint_tuple(serde, scope, thread_id, ns, checkpoint_id)
            if t is None:
                continue
            if filter and not all(t.metadata.get(k) == v for k, v in filter.items()):
                continue
            if left is not None:
                left -= 1
            yield t

    def get_tuple(self, serde: SerializerProtocol, config: RunnableConfig) -> EngramOp[CheckpointTuple | None]:
        configurable = config.get("configurable") or {}
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns") or ""
        scope = self.scope_of(thread_id)
        yield from self.refresh(scope)
        if configurable.get("checkpoint_id"):
            return self.checkpoint_tuple(serde, scope, thread_id, ns, str(configurable["checkpoint_id"]))
        with self.lock:
            thread = self.state(scope).threads.get(thread_id)
            ids = sorted((cid for cns, cid in (thread.checkpoints if thread else {}) if cns == ns), reverse=True)
        for checkpoint_id in ids:
            # Newest first; one that cannot be put together was warned about and is passed.
            t = self.checkpoint_tuple(serde, scope, thread_id, ns, checkpoint_id)
            if t is not None:
                return t
        return None

    # Writing.

    def unit(self, scope: Scope, kind: str, body: dict[str, Any], payloads: Sequence[tuple[str, bytes]]) -> _Unit:
        """The event of ``kind`` with ``body`` and ``payloads``, cutting the largest payloads
        into chunk events until its data fits :data:`MAX_EVENT_DATA`."""
        body = {**body, "types": [t for t, _ in payloads]}
        items: list[Any] = [raw.hex() for _, raw in payloads]
        data: dict[str, Any] = {MARKER: FORMAT, "type": kind, "body": _hex_json(body), "payloads": items}
        size = len(json.dumps(data))
        chunks: list[tuple[dict[str, Any], int]] = []
        for i in sorted(range(len(items)), key=lambda i: -len(payloads[i][1])):
            if size <= MAX_EVENT_DATA or len(items[i]) < 1024:
                break
            raw = payloads[i][1]
            ref = uuid7()
            pieces = [raw[at : at + CHUNK_BYTES] for at in range(0, len(raw), CHUNK_BYTES)]
            for index, piece in enumerate(pieces):
                chunk = {MARKER: FORMAT, "type": "chunk", "ref": ref, "index": index, "count": len(pieces), "hex": piece.hex()}
                chunks.append((self.event(scope, "chunk", chunk), len(json.dumps(chunk)) + 1024))
            manifest = {"ref": ref, "count": len(pieces), "size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
            size += len(json.dumps(manifest)) - len(items[i]) - 2
            items[i] = manifest
        if size > MAX_EVENT_DATA:
            raise TooLarge(
                f"a LangGraph {kind} event of thread {body.get('thread_id')!r} needs {size} characters of data "
                f"with its large payloads chunked, past the limit of {MAX_EVENT_DATA} per event: "
                "too many channels or writes in one step, or too long names"
            )
        return _Unit(self.event(scope, kind, data), size + 1024, chunks)

    def event(self, scope: Scope, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        # No text: checkpoints are no text memories (see the module docs).
        return _ops.event(self.context, "", scope=scope, layer=LAYER, kind=KIND, data=data, tags=[TAG, f"{TAG}:{kind}"])

    def append(self, units: Sequence[_Unit]) -> EngramOp[None]:
        """Appends the units in order; an event that refers to chunks goes in a request
        after theirs, so that it is never visible before them."""
        batch: list[dict[str, Any]] = []
        batch_size = 0
        for unit in units:
            if unit.chunks:
                if batch:
                    yield from self.send(batch)
                    batch, batch_size = [], 0
                group: list[dict[str, Any]] = []
                group_size = 0
                for event, size in unit.chunks:
                    if group and group_size + size > MAX_REQUEST:
                        yield from self.send(group)
                        group, group_size = [], 0
                    group.append(event)
                    group_size += size
                yield from self.send(group)
            if batch and (batch_size + unit.size > MAX_REQUEST or len(batch) >= _ops.MAX_BATCH):
                yield from self.send(batch)
                batch, batch_size = [], 0
            batch.append(unit.event)
            batch_size += unit.size
        if batch:
            yield from self.send(batch)
        return None

    def send(self, events: list[dict[str, Any]]) -> EngramOp[None]:
        results = yield from _ops.append_batch(self.context, events)
        for r in results:
            error = r.get("error")
            if error:
                raise error_for(status_of(str(error.get("code"))), {"error": error})
        return None

    def put(
        self,
        serde: SerializerProtocol,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> EngramOp[RunnableConfig]:
        configurable = config.get("configurable") or {}
        thread_id = str(configurable["thread_id"])
        ns = configurable.get("checkpoint_ns") or ""
        record: dict[str, Any] = dict(checkpoint)
        values: dict[str, Any] = record.pop("channel_values", None) or {}
        # The config's own metadata merged in, as LangGraph's savers do (less the legacy
        # `writes`, which newer versions leave out: get_serializable_checkpoint_metadata).
        md: dict[str, Any] = dict(get_checkpoint_metadata(config, metadata))
        md.pop("writes", None)
        run_id = md.get("run_id")
        blobs = list(new_versions.items())
        payloads = [serde.dumps_typed(record), serde.dumps_typed(md)]
        payloads += [serde.dumps_typed(values[ch]) if ch in values else ("empty", b"") for ch, _ in blobs]
        body = {
            "thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"],
            "parent_checkpoint_id": configurable.get("checkpoint_id"),
            "run_id": str(run_id) if run_id is not None else None,
            "blobs": [[ch, v] for ch, v in blobs],
        }
        yield from self.append([self.unit(self.scope_of(thread_id), "checkpoint", body, payloads)])
        return _config(thread_id, ns, checkpoint["id"])

    def put_writes(
        self,
        serde: SerializerProtocol,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> EngramOp[None]:
        configurable = config.get("configurable") or {}
        thread_id = str(configurable["thread_id"])
        checkpoint_id = configurable.get("checkpoint_id")
        if not checkpoint_id:
            raise ValueError("put_writes needs the checkpoint's config (with a checkpoint_id)")
        if not writes:
            return None
        entries = [[task_id, task_path, WRITES_IDX_MAP.get(ch, idx), ch] for idx, (ch, _) in enumerate(writes)]
        body = {
            "thread_id": thread_id, "checkpoint_ns": configurable.get("checkpoint_ns") or "",
            "checkpoint_id": str(checkpoint_id), "writes": entries,
        }
        payloads = [serde.dumps_typed(v) for _, v in writes]
        yield from self.append([self.unit(self.scope_of(thread_id), "writes", body, payloads)])
        return None

    def delete_thread(self, thread_id: str) -> EngramOp[None]:
        scope = self.scope_of(thread_id)
        state = yield from self.refresh(scope)
        with self.lock:
            exists = thread_id in state.threads
        if exists:
            yield from self.append([self.unit(scope, "delete_thread", {"thread_id": thread_id}, [])])
        return None

    def drop(self, scope: Scope, thread_id: str, keys: list[tuple[str, str]], reason: str) -> list[_Unit]:
        return [
            self.unit(scope, "drop", {"thread_id": thread_id, "checkpoints": [list(k) for k in keys[at : at + _MAX_DROPS]], "reason": reason}, [])
            for at in range(0, len(keys), _MAX_DROPS)
        ]

    def delete_for_runs(self, run_ids: Sequence[str]) -> EngramOp[None]:
        runs = {str(r) for r in run_ids}
        if not runs:
            return None
        scopes = yield from self.every_scope()
        for scope in scopes:
            units: list[_Unit] = []
            with self.lock:
                for thread_id, t in self.state(scope).threads.items():
                    keys = sorted(k for k, saved in t.checkpoints.items() if saved.run_id in runs)
                    if keys:
                        units += self.drop(scope, thread_id, keys, "delete_for_runs")
            if units:
                yield from self.append(units)
        return None

    def prune(self, thread_ids: Sequence[str], strategy: str) -> EngramOp[None]:
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"prune strategy {strategy!r}: use keep_latest or delete")
        for thread_id in dict.fromkeys(str(t) for t in thread_ids):
            if strategy == "delete":
                yield from self.delete_thread(thread_id)
                continue
            scope = self.scope_of(thread_id)
            state = yield from self.refresh(scope)
            with self.lock:
                thread = state.threads.get(thread_id)
                keys = sorted((thread.checkpoints if thread else {}).keys())
            latest: dict[str, str] = {}
            for ns, cid in keys:
                latest[ns] = max(latest.get(ns, cid), cid)
            dropped = [(ns, cid) for ns, cid in keys if latest[ns] != cid]
            if dropped:
                yield from self.append(self.drop(scope, thread_id, dropped, "prune"))
        return None

    def copy_thread(self, serde: SerializerProtocol, source: str, target: str) -> EngramOp[None]:
        source, target = str(source), str(target)
        src_scope, dst_scope = self.scope_of(source), self.scope_of(target)
        state = yield from self.refresh(src_scope)
        units: list[_Unit] = []
        written: set[tuple[str, str, Version]] = set()
        with self.lock:
            thread = state.threads.get(source) or _Thread()
            # In stream order, so that the copy's "last put wins" agrees with the source's.
            saved = sorted(thread.checkpoints.items(), key=lambda kv: kv[1].seq)
            for (ns, cid), s in saved:
                try:
                    record = (s.checkpoint[0], state.resolve(s.checkpoint[1]))
                    md = (s.metadata[0], state.resolve(s.metadata[1]))
                    versions = serde.loads_typed(record).get("channel_versions") or {}
                    blobs: list[tuple[str, Version, tuple[str, bytes]]] = []
                    for channel, version in versions.items():
                        blob = thread.blobs.get((ns, channel, version))
                        if blob is not None and (ns, channel, version) not in written:
                            blobs.append((channel, version, (blob[0], state.resolve(blob[1]))))
                    writes = sorted((thread.writes.get((ns, cid)) or {}).values(), key=_sort_key)
                    values = [(w, (w.value[0], state.resolve(w.value[1]))) for w in writes]
                except _Broken as why:
                    logger.warning("EngramSaver: not copying checkpoint %s of thread %r: %s", cid, source, why)
                    continue
                written.update((ns, ch, v) for ch, v, _ in blobs)
                body = {
                    "thread_id": target, "checkpoint_ns": ns, "checkpoint_id": cid,
                    "parent_checkpoint_id": s.parent, "run_id": s.run_id,
                    "blobs": [[ch, v] for ch, v, _ in blobs],
                }
                units.append(self.unit(dst_scope, "checkpoint", body, [record, md, *(b for _, _, b in blobs)]))
                for at in range(0, len(values), _MAX_WRITES):
                    part = values[at : at + _MAX_WRITES]
                    wbody = {
                        "thread_id": target, "checkpoint_ns": ns, "checkpoint_id": cid,
                        "writes": [[w.task_id, w.task_path, w.idx, w.channel] for w, _ in part],
                    }
                    units.append(self.unit(dst_scope, "writes", wbody, [v for _, v in part]))
        if units:
            yield from self.append(units)
        return None


class EngramSaver(BaseCheckpointSaver[str]):
    """LangGraph's ``BaseCheckpointSaver`` on Engram (see the module docs for the mapping).

    ``client`` serves the sync methods and ``aclient`` the async ones; with only one of
    them, the other kind of call runs through it (async ones in a worker thread; sync ones
    need ``client``). ``scope=`` keeps every thread in one scope instead of one
    ``session`` scope per thread. ``serde`` is LangGraph's serializer (its default if None).

    >>> saver = EngramSaver(Engram(url, key))                # or aclient=AsyncEngram(...)
    >>> graph = builder.compile(checkpointer=saver)
    >>> graph.invoke(inputs, {"configurable": {"thread_id": "chat-42"}})
    """

    def __init__(
        self,
        client: Engram | None = None,
        *,
        aclient: AsyncEngram | None = None,
        scope: ScopeLike | None = None,
        serde: SerializerProtocol | None = None,
    ) -> None:
        super().__init__(serde=serde)
        if client is None and aclient is None:
            raise ValueError("give an Engram client, an AsyncEngram one, or both")
        self.client = client
        self.aclient = aclient
        context = (client or aclient).context  # type: ignore[union-attr]
        self._core = _SaverCore(context, Scope.parse(scope) if scope is not None else None)

    @property
    def scope(self) -> Scope | None:
        """The one scope of every thread, or None: each thread in its session scope."""
        return self._core.scope

    def scope_of(self, thread_id: str) -> Scope:
        """The scope a thread's checkpoints are events of."""
        return self._core.scope_of(str(thread_id))

    def _run(self, op: EngramOp[Any]) -> Any:
        if self.client is None:
            op.close()
            raise RuntimeError("this EngramSaver has only an async client: use the a* methods")
        return self.client.run(op)

    async def _arun(self, op: EngramOp[Any]) -> Any:
        if self.aclient is None:
            return await asyncio.to_thread(self._run, op)
        return await self.aclient.run(op)

    # Sync.

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._run(self._core.get_tuple(self.serde, config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        found = self._run(self._core.candidates(config, before))
        yield from self._core.tuples(self.serde, found, filter, limit)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return self._run(self._core.put(self.serde, config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self._run(self._core.put_writes(self.serde, config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._run(self._core.delete_thread(str(thread_id)))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self._run(self._core.delete_for_runs(run_ids))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._run(self._core.copy_thread(self.serde, source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self._run(self._core.prune(thread_ids, strategy))

    # Async.

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await self._arun(self._core.get_tuple(self.serde, config))

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        found = await self._arun(self._core.candidates(config, before))
        for t in self._core.tuples(self.serde, found, filter, limit):
            yield t

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await self._arun(self._core.put(self.serde, config, checkpoint, metadata, new_versions))

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await self._arun(self._core.put_writes(self.serde, config, writes, task_id, task_path))

    async def adelete_thread(self, thread_id: str) -> None:
        await self._arun(self._core.delete_thread(str(thread_id)))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self._arun(self._core.delete_for_runs(run_ids))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self._arun(self._core.copy_thread(self.serde, source_thread_id, target_thread_id))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self._arun(self._core.prune(thread_ids, strategy))

    def get_next_version(self, current: str | None, channel: None) -> str:
        # As InMemorySaver's: a counter plus a random fraction, so that two forks of one
        # checkpoint never write different values under the same (channel, version).
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(str(current).split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"
