"""``EngramSaver`` against ``langgraph-checkpoint-conformance``, the checkpointer suite
written by LangGraph's authors, run against a real ``engram up``.

Each capability is one test, run with a fresh saver (the suite's factory) in two set-ups:
``per-thread`` (an ``AsyncEngram``, each thread in its own ``session`` scope: the default
mapping) and ``one-scope`` (a sync ``Engram`` only, so the async methods run it in a worker
thread, and every thread in one fresh ``task`` scope). The base capabilities (put,
put_writes, get_tuple, list, delete_thread) must pass; so do the extended ones
(delete_for_runs, copy_thread, prune), which the saver implements. A capability that came to
fail would be listed in ``EXPECTED_FAILURES`` with the reason, as an expected failure.
"""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import BASE_CAPABILITIES, EXTENDED_CAPABILITIES
from langgraph.checkpoint.conformance.initializer import RegisteredCheckpointer

from engram_client import AsyncEngram, Engram, RetryPolicy
from engram_client.checkpoint import EngramSaver

from .conftest import TENANT, Server

BASE = sorted(c.value for c in BASE_CAPABILITIES)
EXTENDED = sorted(c.value for c in EXTENDED_CAPABILITIES)
SETUPS = ("per-thread", "one-scope")
#: (set-up, capability) -> why it fails. Empty: every capability passes in both set-ups.
EXPECTED_FAILURES: dict[tuple[str, str], str] = {}
#: The suite makes a few thousand requests; the gateway allows a key 50 a second.
RETRY = RetryPolicy(max_retries=10)


@pytest.fixture(scope="module")
def registered(server: Server) -> dict[str, RegisteredCheckpointer]:
    # One key per set-up: the gateway's rate limit is per key.
    keys = {s: server.key(TENANT, f"lg-conformance-{s}", "task:*", "session:*") for s in SETUPS}

    @checkpointer_test(name="EngramSaver (AsyncEngram, a session scope per thread)")
    async def per_thread() -> AsyncIterator[EngramSaver]:
        async with AsyncEngram(server.http, keys["per-thread"], retry=RETRY) as client:
            yield EngramSaver(aclient=client)

    @checkpointer_test(name="EngramSaver (Engram, one task scope)")
    async def one_scope() -> AsyncIterator[EngramSaver]:
        with Engram(server.http, keys["one-scope"], retry=RETRY) as client:
            yield EngramSaver(client, scope=f"task:conformance-{uuid.uuid4().hex[:12]}")

    return {"per-thread": per_thread, "one-scope": one_scope}


def _cases(capabilities: list[str]) -> list[Any]:
    cases = []
    for setup in SETUPS:
        for capability in capabilities:
            why = EXPECTED_FAILURES.get((setup, capability))
            marks = [pytest.mark.xfail(reason=why, strict=True)] if why else []
            cases.append(pytest.param(setup, capability, marks=marks, id=f"{setup}-{capability}"))
    return cases


async def _run(registered: dict[str, RegisteredCheckpointer], setup: str, capability: str) -> None:
    report = await validate(registered[setup], capabilities={capability})
    result = report.results[capability]
    assert result.detected, f"{capability}: EngramSaver does not override its method"
    assert result.passed, f"{capability}: {result.tests_failed} failed:\n" + "\n".join(result.failures)
    assert result.tests_passed > 0
    print(f"{setup} {capability}: {result.tests_passed} passed, {result.tests_failed} failed")


@pytest.mark.parametrize(("setup", "capability"), _cases(BASE))
async def test_base_capability(registered: dict[str, RegisteredCheckpointer], setup: str, capability: str) -> None:
    await _run(registered, setup, capability)


@pytest.mark.parametrize(("setup", "capability"), _cases(EXTENDED))
async def test_extended_capability(registered: dict[str, RegisteredCheckpointer], setup: str, capability: str) -> None:
    await _run(registered, setup, capability)
