"""``EngramSaver`` against a real ``engram up``: what LangGraph's conformance suite
(test_checkpoint_conformance.py) does not cover: the events it writes, checkpoints larger
than one event (and one request), several instances on one thread, malformed events in the
scope, names the gateway's secret scrubber would rewrite, and a real graph interrupted on one
"machine" and resumed on another.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import uuid
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.checkpoint.base import Checkpoint, CheckpointMetadata
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.serde.types import ERROR, INTERRUPT
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from engram_client import AsyncEngram, Engram, RetryPolicy, Scope, TooLarge
from engram_client.checkpoint import MAX_EVENT_DATA, TAG, EngramSaver, thread_scope

from .conftest import TENANT, Server

RETRY = RetryPolicy(max_retries=10)
LOGGER = "engram_client.checkpoint"


@pytest.fixture(scope="module")
def key(server: Server) -> str:
    return server.key(TENANT, "lg-saver", "task:*", "session:*")


@pytest.fixture
def client(server: Server, key: str) -> Engram:
    return Engram(server.http, key, retry=RETRY)


def _checkpoint(values: dict[str, Any] | None = None, versions: dict[str, Any] | None = None) -> Checkpoint:
    values = values or {}
    return Checkpoint(
        v=1, id=str(uuid6(clock_seq=-1)), ts="2026-01-01T00:00:00+00:00",
        channel_values=values, channel_versions=versions if versions is not None else {k: 1 for k in values},
        versions_seen={}, updated_channels=None,
    )


def _md(step: int, **extra: Any) -> CheckpointMetadata:
    return CheckpointMetadata(source="loop", step=step, parents={}, **extra)  # type: ignore[typeddict-item]


def _config(thread_id: str, ns: str = "", checkpoint_id: str | None = None) -> Any:
    configurable = {"thread_id": thread_id, "checkpoint_ns": ns}
    if checkpoint_id:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


def _ours(client: Engram, scope: Scope | str) -> list[dict[str, Any]]:
    """The saver's events in the scope, as stored."""
    return [r["event"] for r in client.replay(scope=scope) if TAG in r["event"].get("tags", [])]


def _data(e: dict[str, Any]) -> Any:
    return e["content"]["data"]


def test_thread_scopes() -> None:
    assert thread_scope("chat-42") == Scope("session", "chat-42")
    assert thread_scope("a" * 64) == Scope("session", "a" * 64)
    for odd in ["ticket #42", "alice@example.com", "a" * 65, "", "dé"]:
        scope = thread_scope(odd)
        assert scope.kind == "session" and scope.id.startswith("t-") and len(scope.id) == 42
        assert Scope.parse(str(scope)) == scope
    assert thread_scope("x y") != thread_scope("x  y")


def test_put_get_list_round_trip(client: Engram) -> None:
    saver = EngramSaver(client)
    tid = f"rt-{uuid.uuid4().hex[:8]}"
    first = _checkpoint({"messages": ["hi"], "count": 1, "blob": b"\x00\xff"})
    c1 = saver.put(_config(tid), first, _md(0, run_id="run-1"), first["channel_versions"])
    assert c1 == _config(tid, "", first["id"])
    # Only `count` changes: the others are read from the versions the first put wrote.
    second = _checkpoint({"messages": ["hi"], "count": 2, "blob": b"\x00\xff"}, {"messages": 1, "count": 2, "blob": 1})
    c2 = saver.put(c1, second, _md(1, run_id="run-2"), {"count": 2})
    child = _checkpoint({"sub": "value"})
    saver.put(_config(tid, "child:1"), child, _md(0), {"sub": 1})

    latest = saver.get_tuple(_config(tid))
    assert latest is not None and latest.config == c2
    assert latest.checkpoint["channel_values"] == {"messages": ["hi"], "count": 2, "blob": b"\x00\xff"}
    assert latest.parent_config == c1 and latest.metadata["run_id"] == "run-2"
    older = saver.get_tuple(c1)
    assert older is not None and older.checkpoint["channel_values"]["count"] == 1 and older.parent_config is None
    assert saver.get_tuple(_config(tid, "child:1")).checkpoint["channel_values"] == {"sub": "value"}  # type: ignore[union-attr]
    assert saver.get_tuple(_config(tid, "", str(uuid6(clock_seq=-1)))) is None
    assert saver.get_tuple(_config("no-such-thread")) is None

    assert [t.checkpoint["id"] for t in saver.list(_config(tid))] == [second["id"], first["id"]]
    every_ns = {"configurable": {"thread_id": tid}}
    assert {t.checkpoint["id"] for t in saver.list(every_ns)} == {first["id"], second["id"], child["id"]}
    assert [t.checkpoint["id"] for t in saver.list(_config(tid), filter={"run_id": "run-1"})] == [first["id"]]
    assert [t.checkpoint["id"] for t in saver.list(_config(tid), before=c2)] == [first["id"]]
    assert len(list(saver.list(_config(tid), limit=1))) == 1

    # The events: episodic checkpoints, no text (no retrieval), no top-level `finished`.
    events = _ours(client, saver.scope_of(tid))
    assert [_data(e)["type"] for e in events] == ["checkpoint"] * 3
    for e in events:
        assert e["kind"] == "checkpoint" and e["layer"] == "episodic" and e["content"]["text"] == ""
        assert "finished" not in _data(e) and f"{TAG}:checkpoint" in e["tags"]
    assert saver.scope_of(tid) == Scope("session", tid)


def test_pending_writes(client: Engram) -> None:
    saver = EngramSaver(client)
    tid = f"pw-{uuid.uuid4().hex[:8]}"
    cp = _checkpoint()
    config = saver.put(_config(tid), cp, _md(0), {})
    saver.put_writes(config, [("b", 1), ("a", {"x": [1, 2]})], "task-2", task_path="~b")
    saver.put_writes(config, [("c", "first")], "task-1", task_path="~a")
    saver.put_writes(config, [("c", "retried")], "task-1", task_path="~a")  # a retry: kept once
    saver.put_writes(config, [(ERROR, "boom")], "task-3")
    saver.put_writes(config, [(ERROR, "boom again"), (INTERRUPT, {"ask": "?"})], "task-3")  # special: replaced
    t = saver.get_tuple(config)
    assert t is not None
    # In writes_sort_key order: (task_path, task_id, idx).
    assert t.pending_writes == [
        ("task-3", INTERRUPT, {"ask": "?"}), ("task-3", ERROR, "boom again"),
        ("task-1", "c", "first"), ("task-2", "b", 1), ("task-2", "a", {"x": [1, 2]}),
    ]
    # Writes belong to their checkpoint: the next one starts without any.
    nxt = saver.put(config, _checkpoint(), _md(1), {})
    assert saver.get_tuple(nxt).pending_writes == []  # type: ignore[union-attr]


def test_a_checkpoint_larger_than_an_event_and_a_request(server: Server, key: str, client: Engram) -> None:
    saver = EngramSaver(client)
    tid = f"big-{uuid.uuid4().hex[:8]}"
    big = os.urandom(700_000)  # 1.4 MB as hex: five chunk events, more than a 1 MiB request
    cp = _checkpoint({"big": big, "small": "s"})
    config = saver.put(_config(tid), cp, _md(0), cp["channel_versions"])
    saver.put_writes(config, [("big", big[:300_000])], "task-1")
    other = EngramSaver(Engram(server.http, key, retry=RETRY))
    t = other.get_tuple(_config(tid))
    assert t is not None and t.checkpoint["channel_values"] == {"big": big, "small": "s"}
    assert t.pending_writes == [("task-1", "big", big[:300_000])]
    events = _ours(client, saver.scope_of(tid))
    kinds = [_data(e)["type"] for e in events]
    assert kinds.count("chunk") >= 6 and kinds.count("checkpoint") == 1 and kinds.count("writes") == 1
    # Each event within the server's 512 KiB, each referring event after its chunks.
    assert all(len(json.dumps(e)) < 512 * 1024 for e in events)
    assert kinds.index("checkpoint") > kinds.index("chunk")


def test_a_body_past_one_event_is_refused_with_its_size() -> None:
    # Payloads are chunked whatever their size; ids and names are not. Refused before any
    # request (nothing listens on the discard port).
    saver = EngramSaver(Engram("http://127.0.0.1:9", "egk.acme.a.seed"))
    writes = [(f"channel-{i:05d}-" + "x" * 100, i) for i in range(5000)]
    with pytest.raises(TooLarge, match=f"past the limit of {MAX_EVENT_DATA} per event"):
        saver.put_writes(_config("t", "", "cp-1"), writes, "task")


def test_two_instances_share_a_thread(server: Server, key: str) -> None:
    a = EngramSaver(Engram(server.http, key, retry=RETRY))
    b = EngramSaver(Engram(server.http, key, retry=RETRY))
    tid = f"shared-{uuid.uuid4().hex[:8]}"
    first = _checkpoint({"step": "a"})
    ca = a.put(_config(tid), first, _md(0), {"step": 1})
    seen = b.get_tuple(_config(tid))
    assert seen is not None and seen.checkpoint["id"] == first["id"]
    second = _checkpoint({"step": "b"}, {"step": 2})
    cb = b.put(ca, second, _md(1), {"step": 2})
    b.put_writes(cb, [("step", "c")], "task-b")
    back = a.get_tuple(_config(tid))
    assert back is not None and back.config == cb and back.checkpoint["channel_values"] == {"step": "b"}
    assert back.pending_writes == [("task-b", "step", "c")]
    assert [t.checkpoint["id"] for t in a.list(_config(tid))] == [second["id"], first["id"]]
    a.delete_thread(tid)
    assert b.get_tuple(_config(tid)) is None and list(b.list(_config(tid))) == []


def test_names_the_secret_scrubber_would_rewrite_round_trip(client: Engram) -> None:
    # A subgraph's namespace reads as `api_key: <value>` and a channel value as a password:
    # the gateway would redact both in a plain event; the saver's hex passes unchanged.
    saver = EngramSaver(client, scope=f"task:scrub-{uuid.uuid4().hex[:8]}")
    tid = "password=hunter2-thread"
    ns = f"fetch_api_key:{uuid.uuid4()}"
    cp = _checkpoint({"note": "db password=hunter2 and token: 9fKxA8q2LmZ0rT5vW1yB"})
    config = saver.put(_config(tid, ns), cp, _md(0, source_note="api_key=9fKxA8q2LmZ0rT5vW1yB"), cp["channel_versions"])
    saver.put_writes(config, [("secret_key", "sk-" + "a1" * 20)], "task-1")
    fresh = EngramSaver(client, scope=saver.scope)
    t = fresh.get_tuple(_config(tid, ns))
    assert t is not None and t.config == config
    assert t.checkpoint["channel_values"] == cp["channel_values"]
    assert t.metadata["source_note"] == "api_key=9fKxA8q2LmZ0rT5vW1yB"
    assert t.pending_writes == [("task-1", "secret_key", "sk-" + "a1" * 20)]


def test_malformed_events_are_skipped_with_a_warning(client: Engram, caplog: pytest.LogCaptureFixture) -> None:
    scope = f"task:malformed-{uuid.uuid4().hex[:8]}"
    saver = EngramSaver(client, scope=scope)
    tid = "t1"
    good = _checkpoint({"v": "good"})
    config = saver.put(_config(tid), good, _md(0), {"v": 1})
    saver.put_writes(config, [("w", "ok")], "task-1")

    def body(**fields: Any) -> str:
        return json.dumps(fields).encode().hex()

    later = str(uuid6(clock_seq=-1))
    bad_data: list[Any] = [
        {"langgraph_checkpoint": 1, "type": "checkpoint", "body": "zz", "payloads": []},
        {"langgraph_checkpoint": 1, "type": "checkpoint", "body": body(thread_id=tid), "payloads": []},
        {"langgraph_checkpoint": 1, "type": "checkpoint", "body": body(thread_id=tid, checkpoint_ns="", checkpoint_id=later, blobs=[], types=["msgpack", "msgpack"]), "payloads": ["00"]},
        {"langgraph_checkpoint": 99, "type": "checkpoint", "body": "", "payloads": []},
        {"langgraph_checkpoint": 1, "type": "teleport", "body": body(thread_id=tid)},
        {"langgraph_checkpoint": 1, "type": "writes", "body": body(thread_id=tid, checkpoint_ns="", checkpoint_id=good["id"], writes=[["task-9", "", 0, "w"]], types=["msgpack"]), "payloads": ["not hex"]},
        {"langgraph_checkpoint": 1, "type": "chunk", "ref": "r", "index": 3, "count": 2, "hex": "00"},
        {"langgraph_checkpoint": 1, "type": "drop", "body": body(thread_id=tid, checkpoints=[good["id"]])},
        {"langgraph_checkpoint": 1, "type": "delete_thread", "body": body(thread=tid)},
        [1, 2, 3],
        # A newer checkpoint whose payload is in chunks that never arrived.
        {"langgraph_checkpoint": 1, "type": "checkpoint",
         "body": body(thread_id=tid, checkpoint_ns="", checkpoint_id=later, parent_checkpoint_id=good["id"], run_id=None, blobs=[], types=["msgpack", "msgpack"]),
         "payloads": [{"ref": "gone", "count": 1, "size": 4, "sha256": "0" * 64}, "80"]},
    ]
    events = [client.event("", scope=scope, kind="checkpoint", tags=[TAG], data=d) for d in bad_data]
    # Not the saver's: a session's end, for the consolidator. Ignored without a warning.
    events.append(client.event("", scope=scope, kind="checkpoint", layer="working", data={"finished": True}))
    events.append(client.event("an ordinary memory", scope=scope))
    assert all(r["error"] is None for r in client.append_batch(events))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        fresh = EngramSaver(client, scope=scope)
        t = fresh.get_tuple(_config(tid))
        listed = list(fresh.list(_config(tid)))
    assert t is not None and t.checkpoint["id"] == good["id"] and t.checkpoint["channel_values"] == {"v": "good"}
    assert t.pending_writes == [("task-1", "w", "ok")]
    assert [x.checkpoint["id"] for x in listed] == [good["id"]]
    assert fresh.get_tuple(_config(tid, "", later)) is None
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len([w for w in warnings if "skipping event" in w]) == len(bad_data) - 1
    assert any("chunk 0 of 1 of payload gone is missing" in w for w in warnings)
    # The saver goes on working in the scope.
    saver.put(config, _checkpoint({"v": "after"}, {"v": 2}), _md(1), {"v": 2})
    assert fresh.get_tuple(_config(tid)).checkpoint["channel_values"] == {"v": "after"}  # type: ignore[union-attr]


async def test_the_async_saver(server: Server, key: str) -> None:
    tid = f"async-{uuid.uuid4().hex[:8]}"
    async with AsyncEngram(server.http, key, retry=RETRY) as aclient:
        saver = EngramSaver(aclient=aclient)
        cp = _checkpoint({"x": 1})
        config = await saver.aput(_config(tid), cp, _md(0, run_id="r1"), {"x": 1})
        await saver.aput_writes(config, [("x", 2)], "task-1")
        t = await saver.aget_tuple(_config(tid))
        assert t is not None and t.checkpoint["channel_values"] == {"x": 1} and t.pending_writes == [("task-1", "x", 2)]
        assert [x.config async for x in saver.alist(_config(tid))] == [config]
        await saver.acopy_thread(tid, tid + "-copy")
        copied = await saver.aget_tuple(_config(tid + "-copy"))
        assert copied is not None and copied.checkpoint["id"] == cp["id"] and copied.pending_writes == [("task-1", "x", 2)]
        await saver.adelete_thread(tid)
        assert await saver.aget_tuple(_config(tid)) is None
        assert await saver.aget_tuple(_config(tid + "-copy")) is not None
        # A sync call needs a sync client.
        with pytest.raises(RuntimeError, match="only an async client"):
            saver.get_tuple(_config(tid))


def test_delete_for_runs_from_a_fresh_instance(server: Server, key: str) -> None:
    writer = EngramSaver(Engram(server.http, key, retry=RETRY))
    run = str(uuid.uuid4())
    threads = [f"runs-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for tid in threads:
        c = writer.put(_config(tid), _checkpoint(), _md(0, run_id=run), {})
        writer.put(c, _checkpoint(), _md(1, run_id="kept"), {})
    # An instance that never read these threads finds them in the tenant's session scopes.
    EngramSaver(Engram(server.http, key, retry=RETRY)).delete_for_runs([run])
    for tid in threads:
        assert [t.metadata["run_id"] for t in writer.list(_config(tid))] == ["kept"]
    everything = list(writer.list(None, filter={"run_id": "kept"}))
    assert {t.config["configurable"]["thread_id"] for t in everything} >= set(threads)


class Ticket(TypedDict, total=False):
    question: str
    answer: str
    log: Annotated[list[str], operator.add]


def _ask(state: Ticket) -> Ticket:
    answer = interrupt({"question": state["question"]})
    return {"answer": answer, "log": [f"asked: {state['question']}"]}


def _finish(state: Ticket) -> Ticket:
    return {"log": [f"done: {state['answer']}"]}


def _builder() -> StateGraph:
    builder = StateGraph(Ticket)
    builder.add_node("ask", _ask)
    builder.add_node("finish", _finish)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "finish")
    builder.add_edge("finish", END)
    return builder


def test_a_graph_interrupted_on_one_machine_resumes_on_another(server: Server, key: str) -> None:
    # A thread id that is no scope id: the thread lives in session:t-<sha256>.
    config: Any = {"configurable": {"thread_id": f"ticket #{uuid.uuid4().hex[:6]} / alice@example.com"}}
    first = EngramSaver(Engram(server.http, key, retry=RETRY))
    graph = _builder().compile(checkpointer=first)
    out = graph.invoke({"question": "deploy on friday?", "log": ["opened"]}, config)
    assert [i.value for i in out["__interrupt__"]] == [{"question": "deploy on friday?"}]

    # Another machine: a new client and saver, nothing shared but the server.
    second = EngramSaver(Engram(server.http, key, retry=RETRY))
    resumed = _builder().compile(checkpointer=second)
    waiting = resumed.get_state(config)
    assert waiting.next == ("ask",) and waiting.tasks[0].interrupts[0].value == {"question": "deploy on friday?"}
    done = resumed.invoke(Command(resume="not on a friday"), config)
    assert done["answer"] == "not on a friday"
    assert done["log"] == ["opened", "asked: deploy on friday?", "done: not on a friday"]
    assert resumed.get_state(config).next == ()
    # The first machine sees the outcome, and the whole history.
    assert graph.get_state(config).values["answer"] == "not on a friday"
    history = list(graph.get_state_history(config))
    assert len(history) >= 4 and history[-1].metadata["source"] == "input"
    scope = second.scope_of(config["configurable"]["thread_id"])
    assert scope.id.startswith("t-") and _ours(first.client, scope)  # type: ignore[arg-type]


async def test_an_async_graph_resumes_from_a_fresh_saver(server: Server, key: str) -> None:
    config: Any = {"configurable": {"thread_id": f"async-graph-{uuid.uuid4().hex[:8]}"}}
    async with AsyncEngram(server.http, key, retry=RETRY) as one:
        graph = _builder().compile(checkpointer=EngramSaver(aclient=one))
        out = await graph.ainvoke({"question": "rollback?", "log": []}, config)
        assert out["__interrupt__"][0].value == {"question": "rollback?"}
    async with AsyncEngram(server.http, key, retry=RETRY) as two:
        graph = _builder().compile(checkpointer=EngramSaver(aclient=two))
        done = await graph.ainvoke(Command(resume="yes"), config)
        assert done["log"] == ["asked: rollback?", "done: yes"]



class Fan(TypedDict, total=False):
    seen: Annotated[list[str], operator.add]


def test_parallel_branches_write_from_worker_threads(server: Server, key: str) -> None:
    # LangGraph runs a step's tasks in worker threads, each calling put_writes on the saver.
    builder = StateGraph(Fan)
    for name in "abcd":
        builder.add_node(name, lambda state, name=name: {"seen": [name]})
        builder.add_edge(START, name)
        builder.add_edge(name, "join")
    builder.add_node("join", lambda state: {"seen": ["join:" + "".join(sorted(state["seen"]))]})
    builder.add_edge("join", END)
    config: Any = {"configurable": {"thread_id": f"fan-{uuid.uuid4().hex[:8]}"}}
    out = builder.compile(checkpointer=EngramSaver(Engram(server.http, key, retry=RETRY))).invoke({"seen": []}, config)
    assert sorted(out["seen"]) == ["a", "b", "c", "d", "join:abcd"]
    other = builder.compile(checkpointer=EngramSaver(Engram(server.http, key, retry=RETRY)))
    assert other.get_state(config).values == out
