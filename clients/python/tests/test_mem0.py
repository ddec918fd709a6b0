"""The mem0-style adapter: mem0's methods and shapes, each effect read back from Engram."""

from __future__ import annotations

import uuid

import pytest

from engram_client import AsyncEngram, Engram, Forbidden
from engram_client.mem0 import AsyncMemory, Memory

from .conftest import Server


@pytest.fixture
def alice(server: Server, alice_key: str) -> Memory:
    return Memory(Engram(server.http, alice_key))


@pytest.fixture
def bob(server: Server, bob_key: str) -> Memory:
    return Memory(Engram(server.http, bob_key))


def test_add_search_get_all_get(alice: Memory) -> None:
    run = f"r-{uuid.uuid4().hex[:8]}"
    added = alice.add("I love pizza with olives", run_id=run, metadata={"category": "food"})
    (item,) = added["results"]
    assert item["event"] == "ADD" and item["memory"] == "I love pizza with olives"
    alice.add(
        [
            {"role": "system", "content": "you are helpful"},
            {"role": "user", "content": "I am allergic to peanuts"},
            {"role": "assistant", "content": "Noted: no peanuts."},
        ],
        run_id=run,
    )
    found = alice.search("what food do I like", run_id=run, limit=2)["results"]
    assert found[0]["id"] == item["id"] and found[0]["memory"] == "I love pizza with olives"
    assert found[0]["metadata"] == {"category": "food"} and found[0]["run_id"] == run
    assert isinstance(found[0]["score"], float) and len(found) == 2
    everything = alice.get_all(run_id=run)["results"]
    assert [m["memory"] for m in everything] == ["I love pizza with olives", "I am allergic to peanuts", "Noted: no peanuts."]
    got = alice.get(item["id"])
    assert got is not None and got["memory"] == "I love pizza with olives" and got["hash"]
    assert alice.get(str(uuid.uuid4())) is None


def test_update_supersedes_and_history_tells_it(alice: Memory) -> None:
    added = alice.add("I live in Lisbon", user_id="alice")["results"][0]
    updated = alice.update(added["id"], "I live in Porto")
    assert updated["message"] == "Memory updated successfully!"
    current = alice.get(added["id"])
    assert current is not None and current["memory"] == "I live in Porto" and current["id"] == updated["id"]
    assert current["updated_at"] is not None
    found = [m["memory"] for m in alice.search("where do I live", user_id="alice")["results"]]
    assert "I live in Porto" in found and "I live in Lisbon" not in found
    alice.delete(added["id"])
    assert alice.get(added["id"]) is None and alice.get(updated["id"]) is None
    history = alice.history(added["id"])
    assert [(h["event"], h["old_memory"], h["new_memory"]) for h in history] == [
        ("ADD", None, "I live in Lisbon"),
        ("UPDATE", "I live in Lisbon", "I live in Porto"),
        ("DELETE", "I live in Porto", None),
    ]
    assert history[-1]["is_deleted"] and history[0]["actor_id"] == "planner"


def test_a_fresh_memory_finds_an_id_in_the_keys_scopes(server: Server, alice_key: str, alice: Memory) -> None:
    run = f"r-{uuid.uuid4().hex[:8]}"
    added = alice.add("found without knowing the run", run_id=run)["results"][0]
    fresh = Memory(Engram(server.http, alice_key))
    got = fresh.get(added["id"])
    assert got is not None and got["memory"] == "found without knowing the run" and got["run_id"] == run
    assert [h["event"] for h in fresh.history(added["id"])] == ["ADD"]


def test_reads_filter_by_every_id_given(alice: Memory) -> None:
    run = f"r-{uuid.uuid4().hex[:8]}"
    alice.add("mine in this run", run_id=run, user_id="alice")
    alice.add("someone else's in this run", run_id=run, user_id="carol")
    assert [m["memory"] for m in alice.get_all(run_id=run, user_id="alice")["results"]] == ["mine in this run"]
    assert len(alice.get_all(run_id=run)["results"]) == 2
    assert [m["memory"] for m in alice.get_all(run_id=run, filters={"user_id": "carol"})["results"]] == [
        "someone else's in this run"
    ]


def test_delete_all_touches_only_the_callers_own_scope(alice: Memory, bob: Memory) -> None:
    alice.add("alice likes tea", user_id="alice")
    bob.add("bob likes coffee", user_id="bob")
    with pytest.raises(Forbidden):
        alice.delete_all(user_id="bob")
    assert [m["memory"] for m in bob.get_all(user_id="bob")["results"]] == ["bob likes coffee"]
    alice.delete_all(user_id="alice")
    assert alice.get_all(user_id="alice")["results"] == []
    assert alice.search("tea", user_id="alice")["results"] == []
    assert [m["memory"] for m in bob.get_all(user_id="bob")["results"]] == ["bob likes coffee"]
    # Without ids, the key's own agent scope: bob's memories are not in it.
    alice.add("a note to myself")
    alice.delete_all()
    assert alice.get_all()["results"] == []
    assert bob.search("coffee", user_id="bob")["results"][0]["memory"] == "bob likes coffee"


async def test_async_memory(server: Server, alice_key: str) -> None:
    run = f"r-{uuid.uuid4().hex[:8]}"
    async with AsyncEngram(server.http, alice_key) as client:
        memory = AsyncMemory(client)
        added = (await memory.add("async memories work", run_id=run))["results"][0]
        found = await memory.search("do async memories work", run_id=run)
        assert found["results"][0]["id"] == added["id"]
        await memory.update(added["id"], "async memories work well")
        assert (await memory.get(added["id"]))["memory"] == "async memories work well"  # type: ignore[index]
        await memory.delete_all(run_id=run)
        assert (await memory.get_all(run_id=run))["results"] == []
