"""The native API against a real ``engram up``: every test asserts an effect the server
shows back (a write read back with its consistency token, a forget gone from retrieval)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest

from engram_client import (
    AsyncEngram,
    Engram,
    Forbidden,
    Invalid,
    RateLimited,
    RetryPolicy,
    TooLarge,
    Unauthenticated,
    uuid7,
)

from .conftest import Server, _lines


@pytest.fixture
def mem(server: Server, alice_key: str, task_scope: str):  # type: ignore[no-untyped-def]
    with Engram(server.http, alice_key, scope=task_scope, instance_id="py-test") as client:
        yield client


def texts(response) -> list[str]:  # type: ignore[no-untyped-def]
    return [r["text"] for r in response["results"]]


def test_append_then_retrieve_with_min_seq_sees_it(mem: Engram) -> None:
    receipt = mem.append("the checkout page times out after 30 s", tags=["checkout"], importance=0.8)
    assert receipt["seq"] > 0 and not receipt["duplicate"]
    found = mem.retrieve("why does checkout time out", min_seq=receipt["seq"], wait_ms=20_000)
    top = found["results"][0]
    assert top["text"] == "the checkout page times out after 30 s"
    assert top["event_id"] == receipt["event_id"]
    assert top["agent_id"] == "planner" and top["tags"] == ["checkout"]
    assert {"dense", "keyword", "fused"} <= set(top["parts"])
    keyword = mem.retrieve("checkout", mode="keyword", min_seq=receipt["seq"])
    assert "the checkout page times out after 30 s" in texts(keyword)


def test_a_retried_append_is_stored_once(mem: Engram) -> None:
    event = mem.event("a retried write", event_id=uuid7())
    first, again = mem.append_batch([event, event])
    assert first["seq"] == again["seq"]
    assert again["duplicate"] and not first["duplicate"]
    events = mem.replay()
    assert [e["event"]["event_id"] for e in events] == [event["event_id"]]
    assert events[0]["event"]["instance_id"] == "py-test"


def test_a_batch_is_appended_in_order_and_replayed_in_order(mem: Engram) -> None:
    results = mem.append_batch([mem.event(f"step {i}", kind="action") for i in range(5)])
    seqs = [r["seq"] for r in results]
    assert seqs == sorted(seqs) and all(r["error"] is None for r in results)
    replayed = mem.replay()
    assert [e["event"]["content"]["text"] for e in replayed] == [f"step {i}" for i in range(5)]
    page = mem.replay_page(after_seq=seqs[1], limit=2)
    assert [e["seq"] for e in page["events"]] == seqs[2:4]


def test_facts_current_and_history(mem: Engram) -> None:
    mem.assert_fact("db", "runs", "postgres 15")
    receipt = mem.assert_fact("db", "runs", "postgres 16")
    current = mem.facts(subject="db", predicate="runs", min_seq=receipt["seq"])["facts"]
    assert [f["object"] for f in current] == ["postgres 16"]
    history = mem.facts(subject="db", predicate="runs", history=True, min_seq=receipt["seq"])["facts"]
    assert sorted(f["object"] for f in history) == ["postgres 15", "postgres 16"]


def test_skills_by_name_and_by_task(mem: Engram) -> None:
    receipt = mem.record_skill(
        "fix-sql-injection", "parameterise a SQL query built from user input",
        steps=["find the string concatenation", "use bound parameters"],
    )
    by_name = mem.skills(name="fix-sql-injection", min_seq=receipt["seq"])["skills"]
    assert by_name and by_name[0]["name"] == "fix-sql-injection"
    by_task = mem.skills(task="parameterise a SQL query", min_seq=receipt["seq"])["skills"]
    assert by_task[0]["name"] == "fix-sql-injection"


def test_a_document_edit_reads_back_and_merges(mem: Engram) -> None:
    edited = mem.edit_doc(
        "task_board", "sprint",
        set={"/items/t-7": {"title": "fix login", "status": "todo", "notes": []}, "/items/t-8": {"title": "drop"}},
    )
    assert edited["seq"] > 0 and edited["view"]["value"]["items"]["t-7"]["title"] == "fix login"
    value = mem.doc_value("task_board", "sprint", min_seq=edited["seq"])
    assert set(value["items"]) == {"t-7", "t-8"}
    again = mem.edit_doc(
        "task_board", "sprint", set={"/items/t-7/status": "doing"}, delete=["/items/t-8"], min_seq=edited["seq"]
    )
    value = mem.doc_value("task_board", "sprint", min_seq=again["seq"])
    assert value["items"]["t-7"]["status"] == "doing" and "t-8" not in value["items"]
    assert mem.doc_conflicts("task_board", "sprint", min_seq=again["seq"]) == []
    listed = mem.docs(min_seq=again["seq"])["docs"]
    assert [(d["doc_type"], d["name"]) for d in listed] == [("task_board", "sprint")]
    history = mem.doc_history("task_board", "sprint", min_seq=again["seq"])["history"]
    assert len(history) == 2


def test_forget_removes_a_memory_from_retrieval(mem: Engram) -> None:
    keep = mem.append("the api key rotates monthly")
    drop = mem.append("the api key is pasted in the wiki")
    assert len(mem.retrieve("api key", mode="keyword", min_seq=drop["seq"])["results"]) == 2
    forgotten = mem.forget([drop["event_id"]], reason="leaked secret")
    left = mem.retrieve("api key", mode="keyword", min_seq=forgotten["seq"])
    assert [r["event_id"] for r in left["results"]] == [keep["event_id"]]


def test_working_memory_put_get_list_delete(mem: Engram) -> None:
    assert mem.working_put("cursor", "page-3", ttl_ms=60_000) > 0
    assert mem.working_get("cursor") == "page-3"
    assert {"key": "cursor", "value": "page-3"} in mem.working_list()
    mem.working_delete("cursor")
    assert mem.working_get("cursor") is None


def test_context_assembles_the_memories_of_a_step(mem: Engram, task_scope: str) -> None:
    receipt = mem.append("the login form posts to /api/session")
    context = mem.build_context("how does login work", task=task_scope.split(":")[1], token_budget=256, min_seq=receipt["seq"])
    assert "the login form posts to /api/session" in context["rendered"]
    assert context["tokens"] <= 256


def test_whoami_and_scopes(mem: Engram, task_scope: str) -> None:
    me = mem.whoami()
    assert (me["tenant"], me["agent"]) == ("acme", "planner")
    assert "user:alice" in me["scopes"] and "task:*" in me["scopes"]
    mem.append("something to count")
    listed = {f"{s['scope']['kind']}:{s['scope']['id']}": s for s in mem.scopes()}
    assert listed[task_scope]["events"] >= 1


def test_tail_streams_events_as_they_are_appended(mem: Engram) -> None:
    first = mem.append("before the tail")
    seen: list[str] = []

    def later() -> None:
        time.sleep(0.5)
        mem.append("during the tail")

    writer = threading.Thread(target=later)
    writer.start()
    for item in mem.tail(after_seq=first["seq"] - 1):
        seen.append(item["event"]["content"]["text"])
        if len(seen) == 2:
            break
    writer.join()
    assert seen == ["before the tail", "during the tail"]


def test_snapshots_bootstrap_and_consolidate_answer(mem: Engram) -> None:
    receipt = mem.assert_fact("service", "owner", "team-core")
    assert isinstance(mem.snapshots(), list)
    boot = mem.bootstrap("facts", min_seq=receipt["seq"])
    assert boot["model"] == "facts"
    plan = mem.consolidate(min_seq=receipt["seq"])
    assert plan["planned"] == len(plan["results"])
    assert mem.dead_letters()["total"] == 0


def test_an_unknown_key_is_unauthenticated(server: Server, alice_key: str) -> None:
    forged = alice_key[:-8] + "AAAAAAAA"
    with Engram(server.http, forged, scope="task:t1", retry=RetryPolicy(max_retries=0)) as bad:
        with pytest.raises(Unauthenticated) as caught:
            bad.retrieve("anything")
    assert caught.value.status == 401 and caught.value.code == "unauthenticated"
    issued_elsewhere = "egk.acme.planner.SUAMYFN74T6QXCYEF5CYQCQ2XZVXQIEBSSINZ67KPNUUORKAY6A3B5T254"
    with Engram(server.http, issued_elsewhere, scope="task:t1", retry=RetryPolicy(max_retries=0)) as bad:
        with pytest.raises(Unauthenticated):
            bad.append("never stored")


def test_another_tenant_is_forbidden(mem: Engram, globex_key: str, server: Server, task_scope: str) -> None:
    with pytest.raises(Forbidden) as caught:
        mem.request("POST", "/v1/retrieve", {"tenant": "globex", "scope": {"kind": "task", "id": "t1"}, "query": "x"})
    assert caught.value.status == 403
    # The victim's memory is there and visible to the victim first, so an empty answer to the
    # intruder below is isolation, not a read model that has not caught up.
    secret = f"acme own memory {uuid.uuid4().hex}"
    receipt = mem.append(secret)
    seen = mem.retrieve(secret, mode="keyword", min_seq=receipt["seq"], wait_ms=20_000)
    assert [r["event_id"] for r in seen["results"]] == [receipt["event_id"]]
    acme_scope = {"kind": "task", "id": task_scope.split(":", 1)[1]}
    with Engram(server.http, globex_key, scope=task_scope) as intruder:
        # Its own tenant's scope of that name holds nothing, in any mode, once every read
        # model has taken the victim's append; acme's scope is out of reach.
        for mode in ("keyword", "hybrid"):
            found = intruder.retrieve(secret, mode=mode, min_seq=receipt["seq"], wait_ms=20_000)
            assert found["results"] == [], mode
        with pytest.raises(Forbidden):
            intruder.request("POST", "/v1/retrieve", {"tenant": "acme", "scope": acme_scope, "query": secret})
        with pytest.raises(Forbidden):
            intruder.request("POST", "/v1/events", {**mem.event("forged"), "tenant": "acme"})
    assert mem.retrieve(secret, mode="keyword", min_seq=receipt["seq"])["results"]


def test_a_scope_the_key_may_not_read_is_forbidden(mem: Engram) -> None:
    with pytest.raises(Forbidden):
        mem.retrieve("anything", scope="user:bob")
    with pytest.raises(Forbidden):
        mem.append("not mine", scope="user:bob")


def test_a_body_over_the_limit_is_too_large(mem: Engram) -> None:
    with pytest.raises(TooLarge) as caught:
        mem.append("x" * (1024 * 1024 + 1))
    assert caught.value.status == 413


def test_a_request_out_of_bounds_is_invalid(mem: Engram) -> None:
    with pytest.raises(Invalid) as caught:
        mem.retrieve("anything", top_k=0)
    assert caught.value.status == 400 and "top_k" in caught.value.message
    with pytest.raises(Invalid):
        mem.retrieve("anything", min_seq=10**12)


@contextmanager
def gateway(server: Server, **settings: float) -> Iterator[str]:
    """``engram gateway`` against the session's NATS, with ``[gateway]`` settings of its own
    (as ``ENGRAM_GATEWAY__*``): the session server's are shared by every test. Yields its URL."""
    env = {k: v for k, v in os.environ.items() if k not in ("ENGRAM_CONFIG", "ENGRAM_CREDS", "ENGRAM_HOME")}
    env.update({f"ENGRAM_GATEWAY__{name.upper()}": str(value) for name, value in settings.items()})
    log = server.home / f"gateway-{uuid.uuid4().hex[:8]}.log"
    with open(log, "w") as stderr:
        child = subprocess.Popen(
            [str(server.bin), "--home", str(server.home), "--nats", server.nats, "gateway", "--listen", "127.0.0.1:0"],
            env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_lines, args=(child.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                line = ""
            if "engram gateway is up" in line:
                break
            assert child.poll() is None and time.monotonic() < deadline, f"engram gateway did not start: {log.read_text()}"
        yield dict(t.split("=", 1) for t in line.split() if "=" in t)["http"]
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def test_rate_limits_are_typed_and_retried_after_retry_after(server: Server, task_scope: str) -> None:
    # One token every 5 s: the burst is spent long before a token comes back, however slow
    # each request is on a busy machine (a 429 fails to come only if requests take 5 s each).
    rate, burst = 0.2, 5
    key = server.key("acme", f"burst-{uuid.uuid4().hex[:6]}")
    with gateway(server, rate_per_second=rate, burst=float(burst)) as url:
        with Engram(url, key, scope=task_scope, retry=RetryPolicy(max_retries=0)) as eager:
            for _ in range(burst):
                assert eager.working_list() == []
            with pytest.raises(RateLimited) as caught:
                for _ in range(50):
                    eager.working_list()
        limited = caught.value
        assert (limited.status, limited.code) == (429, "rate_limited")
        # Retry-After: whole seconds until the next token, at most one token's interval.
        assert limited.retry_after is not None and 1 <= limited.retry_after <= 1 / rate
        with Engram(url, key, scope=task_scope, retry=RetryPolicy(max_retries=5)) as patient:
            assert patient.working_list() == []


def test_retries_stop_at_the_bound(server: Server, alice_key: str) -> None:
    calls = []

    def always_busy(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(503, json={"error": {"code": "unavailable", "message": "down"}}, headers={"retry-after": "0"})

    http = httpx.Client(base_url=server.http, transport=httpx.MockTransport(always_busy))
    with Engram(api_key=alice_key, scope="task:t1", retry=RetryPolicy(max_retries=2), http_client=http) as client:
        with pytest.raises(Exception) as caught:
            client.retrieve("anything")
    assert caught.value.code == "unavailable" and len(calls) == 3  # type: ignore[attr-defined]


async def test_the_async_client_appends_and_retrieves(server: Server, alice_key: str, task_scope: str) -> None:
    async with AsyncEngram(server.http, alice_key, scope=task_scope) as mem:
        receipts = await mem.append_batch([mem.event("async one"), mem.event("async two")])
        last = max(r["seq"] for r in receipts)
        found = await mem.retrieve("async", mode="keyword", min_seq=last)
        assert sorted(texts(found)) == ["async one", "async two"]
        items = []
        async for item in mem.tail():
            if item["event"]["kind"] == "observation":
                items.append(item["event"]["content"]["text"])
            if len(items) == 2:
                break
        assert items == ["async one", "async two"]
