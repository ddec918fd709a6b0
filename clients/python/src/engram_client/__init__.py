"""Python client of Engram, the shared memory layer for AI agents.

- :class:`Engram` and :class:`AsyncEngram`: the HTTP API (``engram up`` serves it), with the
  native API of the Rust SDK: append, retrieve, context, facts, skills, documents,
  snapshots, bootstrap, forget, replay, working memory.
- :mod:`engram_client.nats`: the same async API over NATS with the key's nkey (extra
  ``engram-client[nats]``).
- :mod:`engram_client.mem0`: a mem0-style ``Memory``.
- :mod:`engram_client.langgraph`: a LangGraph ``BaseStore``.
- :mod:`engram_client.errors`: one exception class per error code.

Layout: ``_core`` holds requests, responses and the drivers; ``_ops`` the native API as
I/O-free operations, which ``client`` binds to the sync and async transports.
"""

from ._core import Identity, RetryPolicy, Scope, uuid7
from .client import AsyncEngram, Engram
from .errors import (
    Busy,
    Conflict,
    EngramError,
    Forbidden,
    Internal,
    Invalid,
    NotFound,
    NotYetVisible,
    RateLimited,
    TooLarge,
    TransportError,
    Unauthenticated,
    Unavailable,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncEngram",
    "Busy",
    "Conflict",
    "Engram",
    "EngramError",
    "Forbidden",
    "Identity",
    "Internal",
    "Invalid",
    "NotFound",
    "NotYetVisible",
    "RateLimited",
    "RetryPolicy",
    "Scope",
    "TooLarge",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "uuid7",
]
