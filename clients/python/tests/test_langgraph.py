"""``EngramStore`` against a real ``engram up``.

LangGraph ships no conformance suite for stores (``langgraph-checkpoint-conformance``
covers checkpointers only; the store tests in LangGraph's repository are not packaged), so
these are the same cases, written for this store: basic get/put/delete, namespace listing
with prefix, suffix, wildcards, depth, limit and offset, search by prefix, filter and
query, batch semantics, async, and a second store instance reading the first's writes.
"""

from __future__ import annotations

import uuid
from datetime import datetime

import pytest
from langgraph.store.base import GetOp, Item, ListNamespacesOp, MatchCondition, PutOp, SearchOp

from engram_client import AsyncEngram, Engram
from engram_client.langgraph import EngramStore

from .conftest import Server


@pytest.fixture
def store(server: Server, alice_key: str, task_scope: str) -> EngramStore:
    return EngramStore(Engram(server.http, alice_key), scope=task_scope)


def test_put_get_delete(store: EngramStore) -> None:
    assert store.get(("users", "alice"), "prefs") is None
    store.put(("users", "alice"), "prefs", {"food": "pizza", "lang": "en"})
    item = store.get(("users", "alice"), "prefs")
    assert isinstance(item, Item)
    assert item.value == {"food": "pizza", "lang": "en"}
    assert item.namespace == ("users", "alice") and item.key == "prefs"
    assert isinstance(item.created_at, datetime) and item.created_at.tzinfo is not None
    store.put(("users", "alice"), "prefs", {"food": "ramen"})
    updated = store.get(("users", "alice"), "prefs")
    assert updated is not None and updated.value == {"food": "ramen"}
    assert updated.created_at == item.created_at and updated.updated_at > item.updated_at
    store.delete(("users", "alice"), "prefs")
    assert store.get(("users", "alice"), "prefs") is None
    store.put(("users", "alice"), "prefs", {"food": "soup"})
    again = store.get(("users", "alice"), "prefs")
    assert again is not None and again.value == {"food": "soup"}


def test_list_namespaces(store: EngramStore) -> None:
    for ns in [("a", "b", "c"), ("a", "b", "d", "e"), ("a", "b", "d", "i"), ("a", "b", "f"), ("a", "c", "f"), ("b", "a", "f"), ("users", "123"), ("users", "456", "settings")]:
        store.put(ns, "k", {"ns": list(ns)})
    assert store.list_namespaces(prefix=("a", "b")) == [("a", "b", "c"), ("a", "b", "d", "e"), ("a", "b", "d", "i"), ("a", "b", "f")]
    assert store.list_namespaces(suffix=("f",)) == [("a", "b", "f"), ("a", "c", "f"), ("b", "a", "f")]
    assert store.list_namespaces(prefix=("a",), suffix=("f",)) == [("a", "b", "f"), ("a", "c", "f")]
    assert store.list_namespaces(prefix=("a", "*", "f")) == [("a", "b", "f"), ("a", "c", "f")]
    assert store.list_namespaces(max_depth=2) == [("a", "b"), ("a", "c"), ("b", "a"), ("users", "123"), ("users", "456")]
    assert store.list_namespaces(limit=3) == [("a", "b", "c"), ("a", "b", "d", "e"), ("a", "b", "d", "i")]
    assert store.list_namespaces(offset=6) == [("users", "123"), ("users", "456", "settings")]
    store.delete(("users", "123"), "k")
    assert ("users", "123") not in store.list_namespaces(prefix=("users",))


def test_search_by_prefix_and_filter(store: EngramStore) -> None:
    store.put(("docs", "a"), "1", {"kind": "guide", "pages": 3, "meta": {"lang": "en"}})
    store.put(("docs", "a"), "2", {"kind": "spec", "pages": 10, "meta": {"lang": "fr"}})
    store.put(("docs", "b"), "3", {"kind": "guide", "pages": 7, "meta": {"lang": "en"}})
    store.put(("other",), "4", {"kind": "guide", "pages": 1})
    assert [i.key for i in store.search(("docs",))] == ["1", "2", "3"]
    assert [i.key for i in store.search(("docs", "a"))] == ["1", "2"]
    assert [i.key for i in store.search(("docs",), filter={"kind": "guide"})] == ["1", "3"]
    assert [i.key for i in store.search(("docs",), filter={"pages": {"$gt": 5}})] == ["2", "3"]
    assert [i.key for i in store.search(("docs",), filter={"pages": {"$gte": 3, "$lt": 10}})] == ["1", "3"]
    assert [i.key for i in store.search(("docs",), filter={"kind": {"$ne": "guide"}})] == ["2"]
    assert [i.key for i in store.search(("docs",), filter={"meta.lang": "fr"})] == ["2"]
    assert [i.key for i in store.search((), limit=2, offset=1)] == ["2", "3"]
    assert all(i.score is None for i in store.search(("docs",)))


def test_search_by_query_ranks_by_retrieval(store: EngramStore) -> None:
    store.put(("memories",), "deploy", {"text": "deploys run every friday afternoon"})
    store.put(("memories",), "db", {"text": "the database is postgres 16"})
    store.put(("memories",), "secret", {"text": "the deploy key lives in vault"}, index=False)
    hits = store.search(("memories",), query="when do deploys run")
    assert hits[0].key == "deploy" and hits[0].score is not None
    assert "secret" not in [h.key for h in hits]
    store.put(("memories",), "deploy", {"text": "deploys are frozen in december"})
    hits = store.search(("memories",), query="deploys frozen december")
    assert hits[0].key == "deploy" and hits[0].value["text"] == "deploys are frozen in december"
    assert len([h for h in hits if h.key == "deploy"]) == 1
    store.delete(("memories",), "deploy")
    assert "deploy" not in [h.key for h in store.search(("memories",), query="deploys frozen december")]


def test_batch_reads_see_the_state_before_its_puts(store: EngramStore) -> None:
    store.put(("b",), "x", {"v": 1})
    results = store.batch([
        PutOp(("b",), "x", {"v": 2}),
        GetOp(("b",), "x"),
        PutOp(("b",), "y", {"v": 1}),
        PutOp(("b",), "y", {"v": 3}),
        SearchOp(("b",)),
        ListNamespacesOp(match_conditions=(MatchCondition("prefix", ("b",)),)),
    ])
    assert results[0] is None and results[1].value == {"v": 1}  # type: ignore[union-attr]
    assert [i.key for i in results[4]] == ["x"]  # type: ignore[union-attr]
    assert results[5] == [("b",)]
    assert store.get(("b",), "x").value == {"v": 2}  # type: ignore[union-attr]
    assert store.get(("b",), "y").value == {"v": 3}  # type: ignore[union-attr]


def test_a_second_store_reads_the_first_ones_writes(server: Server, alice_key: str, task_scope: str) -> None:
    first = EngramStore(Engram(server.http, alice_key), scope=task_scope)
    first.put(("shared",), "plan", {"step": "one"})
    second = EngramStore(Engram(server.http, alice_key), scope=task_scope)
    assert second.get(("shared",), "plan").value == {"step": "one"}  # type: ignore[union-attr]
    second.put(("shared",), "plan", {"step": "two"})
    assert first.get(("shared",), "plan").value == {"step": "two"}  # type: ignore[union-attr]


async def test_the_async_store(server: Server, alice_key: str) -> None:
    scope = f"task:t-{uuid.uuid4().hex[:12]}"
    async with AsyncEngram(server.http, alice_key) as client:
        store = EngramStore(aclient=client, scope=scope)
        await store.aput(("a",), "k", {"text": "async store values"})
        item = await store.aget(("a",), "k")
        assert item is not None and item.value == {"text": "async store values"}
        hits = await store.asearch(("a",), query="async store")
        assert [h.key for h in hits] == ["k"]
        assert await store.alist_namespaces() == [("a",)]
        await store.adelete(("a",), "k")
        assert await store.aget(("a",), "k") is None
