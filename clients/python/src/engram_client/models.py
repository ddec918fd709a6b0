"""The shapes of Engram's answers, as TypedDicts (hints only: values are plain dicts).

They follow the Rust types of the query protocol (shared/memory/src/proto.rs, JSON Schema
in schemas/json/query.v1.json) and the gateway's own (services/gateway/src/routes.rs).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, TypedDict


class ScopeJson(TypedDict):
    kind: str
    id: str


class ErrorJson(TypedDict):
    code: str
    message: str


class Receipt(TypedDict):
    """A stored event: ``seq`` is the read-your-writes token."""

    event_id: str
    seq: int
    duplicate: bool


class AppendResult(TypedDict):
    event_id: str
    seq: Optional[int]
    duplicate: bool
    error: Optional[ErrorJson]


class ScoreParts(TypedDict, total=False):
    dense: Optional[float]
    dense_rank: Optional[int]
    keyword: Optional[float]
    keyword_rank: Optional[int]
    fused: float
    recency_boost: float
    importance_boost: float
    date_boost: float


class MemoryResult(TypedDict):
    seq: int
    event_id: str
    tenant: str
    scope: ScopeJson
    agent_id: str
    layer: str
    kind: str
    occurred_at: str
    importance: float
    tags: List[str]
    confidence: float
    text: str
    score: float
    parts: ScoreParts


class RetrieveResponse(TypedDict):
    results: List[MemoryResult]
    summaries: List[MemoryResult]
    visible: List[Tuple[str, int]]


class ContextItem(TypedDict):
    layer: str
    text: str
    tokens: int
    source: str
    score: float


class ContextResponse(TypedDict):
    items: List[ContextItem]
    tokens: int
    token_budget: int
    dropped: int
    rendered: str


class FactsResponse(TypedDict):
    facts: List[dict[str, Any]]
    visible_seq: int


class SkillsResponse(TypedDict):
    skills: List[dict[str, Any]]
    visible_seq: int


class DocConflict(TypedDict):
    path: str
    values: List[Any]


class DocResponse(TypedDict, total=False):
    doc: Optional[dict[str, Any]]
    conflicts: List[DocConflict]
    truncated: bool
    bytes: Optional[str]
    history: List[dict[str, Any]]
    docs: List[dict[str, Any]]
    visible_seq: int


class DocView(TypedDict):
    value: Any
    conflicts: List[DocConflict]
    truncated: bool


class DocEditResponse(TypedDict):
    seq: int
    event_id: str
    view: DocView


class ConsolidateResponse(TypedDict):
    planned: int
    results: List[AppendResult]


class ReplayedEvent(TypedDict):
    seq: int
    stored_at: str
    event: dict[str, Any]


class ReplayResponse(TypedDict):
    events: List[ReplayedEvent]
    first_seq: int
    last_seq: int
    next_after: int
    done: bool


class BootstrapResponse(TypedDict, total=False):
    model: str
    snapshot: Optional[dict[str, Any]]
    skipped: List[str]
    bytes: Optional[str]


class WorkingEntry(TypedDict):
    key: str
    value: str


class Whoami(TypedDict):
    tenant: str
    agent: str
    #: What the key may write and read: ``kind:id``, or ``kind:*`` for every id.
    scopes: List[str]
    #: Granted to it, read only.
    grants: List[str]


class ScopeInfo(TypedDict):
    scope: ScopeJson
    events: int
    layers: dict[str, int]
