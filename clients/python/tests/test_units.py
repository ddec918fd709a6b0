"""What needs no server: error mapping, the retry policy, ids, scopes, the SSE parser, and
an operation run against a scripted transport."""

from __future__ import annotations

import uuid

import httpx
import pytest

from engram_client import Busy, Engram, Forbidden, Internal, NotYetVisible, RateLimited, RetryPolicy, Scope, TransportError, uuid7
from engram_client import _ops
from engram_client._core import Context, Identity, Request, Response, drive
from engram_client.client import _SseParser
from engram_client.errors import Unavailable, error_for


def test_errors_are_typed_by_code_then_status() -> None:
    limited = error_for(429, {"error": {"code": "rate_limited", "message": "slow down"}}, {"retry-after": "2"})
    assert isinstance(limited, RateLimited) and limited.retry_after == 2.0 and limited.retryable
    assert isinstance(error_for(429, {"error": {"code": "busy", "message": ""}}), Busy)
    assert isinstance(error_for(408, {"error": {"code": "not_yet_visible", "message": ""}}), NotYetVisible)
    assert isinstance(error_for(403, "no body"), Forbidden)
    odd = error_for(418, {"error": {"code": "teapot", "message": "short and stout"}})
    assert isinstance(odd, Internal) and odd.code == "teapot" and odd.status == 418
    assert str(limited) == "429 rate_limited: slow down"


def test_the_retry_policy_honours_retry_after_within_bounds() -> None:
    policy = RetryPolicy(max_retries=2, backoff=0.1, max_wait=5)
    assert policy.delay(0, RateLimited("x", status=429, retry_after=3)) == 3
    assert policy.delay(0, RateLimited("x", status=429, retry_after=60)) == 5
    assert policy.delay(1, Unavailable("x", status=503)) == pytest.approx(0.2)
    assert policy.delay(2, Unavailable("x", status=503)) is None
    assert policy.delay(0, Forbidden("x", status=403)) is None
    assert policy.delay(0, TransportError("connection refused")) == pytest.approx(0.1)


def test_uuid7_is_a_time_ordered_version_7_uuid() -> None:
    ids = [uuid7() for _ in range(100)]
    parsed = [uuid.UUID(i) for i in ids]
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in parsed)
    stamps = [u.int >> 80 for u in parsed]
    assert stamps == sorted(stamps) and len(set(ids)) == 100


def test_scopes_parse_and_refuse_what_no_subject_can_hold() -> None:
    assert Scope.parse("task:t-1") == Scope("task", "t-1")
    assert Scope.parse({"kind": "user", "id": "u1"}).json() == {"kind": "user", "id": "u1"}
    for bad in ["task", "galaxy:x", "task:a.b", "task:*", "task:"]:
        with pytest.raises(ValueError):
            Scope.parse(bad)
    assert Identity.of_key("egk.acme.web.SEED") == Identity("acme", "web", "SEED")
    with pytest.raises(ValueError):
        Identity.of_key("sk-not-an-engram-key")


def test_the_sse_parser_yields_events_and_raises_errors() -> None:
    parser = _SseParser()
    lines = ["event: memory", "id: 7", 'data: {"seq": 7, "event": {"kind": "observation"}}', "", ": keep-alive", ""]
    items = [item for item in map(parser.feed, lines) if item is not None]
    assert items == [{"seq": 7, "event": {"kind": "observation"}}]
    for line in ["event: error", 'data: {"error": {"code": "unavailable", "message": "gone"}}']:
        parser.feed(line)
    with pytest.raises(Unavailable):
        parser.feed("")


def test_an_operation_pages_through_a_scripted_transport() -> None:
    pages = [
        {"events": [{"seq": 1}, {"seq": 2}], "first_seq": 1, "last_seq": 3, "next_after": 2, "done": False},
        {"events": [{"seq": 3}], "first_seq": 1, "last_seq": 3, "next_after": 3, "done": True},
    ]
    sent: list[Request] = []

    def send(request: Request) -> Response:
        sent.append(request)
        if len(sent) == 1:
            return Response(503, {"error": {"code": "unavailable", "message": "once"}}, {"retry-after": "0"})
        return Response(200, pages[len(sent) - 2])

    ctx = Context(Identity("acme", "web", "SEED"), default_scope=Scope("task", "t1"))
    events = drive(_ops.replay(ctx), send, RetryPolicy(max_retries=1))
    assert [e["seq"] for e in events] == [1, 2, 3]
    assert [r.body["after_seq"] for r in sent] == [0, 0, 2]
    assert sent[0].body["tenant"] == "acme" and sent[0].body["scope"] == {"kind": "task", "id": "t1"}


class _DroppedStream(httpx.SyncByteStream):
    """An SSE body that sends its events, then fails as a dropped connection would."""

    def __init__(self, seqs: list[int], drop: bool) -> None:
        self.seqs, self.drop = seqs, drop

    def __iter__(self):  # type: ignore[no-untyped-def]
        for seq in self.seqs:
            yield f'event: memory\nid: {seq}\ndata: {{"seq": {seq}, "event": {{}}}}\n\n'.encode()
        if self.drop:
            raise httpx.ReadError("connection reset")


def test_a_dropped_tail_resumes_after_the_last_event() -> None:
    asked: list[str] = []

    def serve(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params["after_seq"])
        if len(asked) == 1:
            return httpx.Response(200, stream=_DroppedStream([4, 5], drop=True))
        return httpx.Response(200, stream=_DroppedStream([6], drop=False))

    http = httpx.Client(base_url="http://engram.test", transport=httpx.MockTransport(serve))
    client = Engram(api_key="egk.acme.web.SEED", scope="task:t1", http_client=http, retry=RetryPolicy(backoff=0))
    assert [item["seq"] for item in client.tail(after_seq=3)] == [4, 5, 6]
    assert asked == ["3", "5"]


def test_queries_about_one_scope_take_the_routed_subject() -> None:
    from engram_client.nats import routed_subject

    who = Identity(tenant="acme", agent="planner", seed="")
    body = {"scope": {"kind": "task", "id": "t-1"}, "query": "x"}
    assert routed_subject(who, "retrieve", body) == "engram.q.acme.planner.retrieve.task.t-1"
    assert routed_subject(who, "context", body) == "engram.q.acme.planner.context.task.t-1"
    # Not routed: other ops, and a scope no subject token can carry (left to the service).
    assert routed_subject(who, "replay", body) is None
    for scope in ({"kind": "task", "id": "a.b"}, {"kind": "task", "id": "*"}, {"kind": "galaxy", "id": "x"}, "task:t1", None):
        assert routed_subject(who, "retrieve", {"scope": scope}) is None
