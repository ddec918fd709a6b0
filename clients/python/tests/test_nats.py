"""The async API over NATS with the key's nkey: every operation, appends included, is
request/reply to the query service on the key's own subjects."""

from __future__ import annotations

import pytest

from engram_client import Forbidden, NotFound, uuid7
from engram_client.nats import NatsTransport, connect

from .conftest import Server


async def test_append_retrieve_and_facts_over_nats(server: Server, alice_key: str, task_scope: str) -> None:
    mem = await connect(server.nats, alice_key, scope=task_scope, instance_id="nats-test")
    try:
        receipt = await mem.append("over nats: the cache is cold after deploys", tags=["cache"])
        assert receipt["seq"] > 0
        found = await mem.retrieve("cold cache", min_seq=receipt["seq"], wait_ms=20_000)
        assert found["results"][0]["event_id"] == receipt["event_id"]
        fact = await mem.assert_fact("cache", "state", "cold")
        facts = await mem.facts(subject="cache", min_seq=fact["seq"])
        assert [f["object"] for f in facts["facts"]] == ["cold"]
        # The stream stores a retried append (same event id) once.
        event = mem.event("published twice", event_id=uuid7())
        first, again = await mem.append_batch([event, event])
        assert first["seq"] == again["seq"] and again["duplicate"]
        replayed = await mem.replay()
        stored = [e["event"] for e in replayed if e["event"]["event_id"] == event["event_id"]]
        assert len(stored) == 1 and stored[0]["instance_id"] == "nats-test"
        forgotten = await mem.forget([receipt["event_id"]], reason="stale")
        left = await mem.retrieve("cold cache", mode="keyword", min_seq=forgotten["seq"])
        assert receipt["event_id"] not in [r["event_id"] for r in left["results"]]
        me = await mem.whoami()
        assert me["agent"] == "planner"
        # Every query about the scope went to the node owning its partition on the routed
        # subject: none fell back to the query service's subject.
        transport = mem._transport.__self__
        assert isinstance(transport, NatsTransport) and transport.unrouted == 0
    finally:
        await mem.aclose()


async def test_nats_refusals_are_typed(server: Server, alice_key: str, task_scope: str) -> None:
    mem = await connect(server.nats, alice_key, scope=task_scope)
    try:
        with pytest.raises(Forbidden):
            await mem.append("not my scope", scope="user:bob")
        with pytest.raises(Forbidden):
            await mem.retrieve("anything", scope="user:bob")
        with pytest.raises(NotFound):
            await mem.edit_doc("scratchpad", "n", set={"/a": 1})
    finally:
        await mem.aclose()


async def test_the_adapters_run_over_nats_too(server: Server, alice_key: str, task_scope: str) -> None:
    from engram_client.langgraph import EngramStore
    from engram_client.mem0 import AsyncMemory

    mem = await connect(server.nats, alice_key)
    try:
        memory = AsyncMemory(mem)
        run = task_scope.split(":")[1]
        added = (await memory.add("nats carries mem0 too", run_id=run))["results"][0]
        assert (await memory.search("what carries mem0", run_id=run))["results"][0]["id"] == added["id"]
        await memory.delete_all(run_id=run)
        assert (await memory.get_all(run_id=run))["results"] == []
        store = EngramStore(aclient=mem, scope=task_scope)
        await store.aput(("ns",), "k", {"text": "a value over nats"})
        item = await store.aget(("ns",), "k")
        assert item is not None and item.value == {"text": "a value over nats"}
        assert [h.key for h in await store.asearch(("ns",), query="value over nats")] == ["k"]
    finally:
        await mem.aclose()
