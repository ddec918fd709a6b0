//! Every Prometheus metric Engram exports. Metrics are process-global and registered lazily
//! in one registry, which `/metrics` renders with [`render`].
//!
//! Labels are low-cardinality on purpose (layer, outcome, error kind): tenants and scopes can
//! number in the millions and would blow up the series count.

use std::sync::LazyLock;

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub static REGISTRY: LazyLock<Registry> = LazyLock::new(Registry::new);

fn register<C: prometheus::core::Collector + Clone + 'static>(c: C) -> C {
    // Registering the same name twice is a programming error caught by every test run.
    REGISTRY
        .register(Box::new(c.clone()))
        .expect("metric registered twice");
    c
}

/// Events acknowledged by the stream, by layer; duplicates are counted separately.
pub static EVENTS_APPENDED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(
        IntCounterVec::new(
            Opts::new(
                "engram_events_appended_total",
                "events stored by the events stream",
            ),
            &["layer"],
        )
        .unwrap(),
    )
});

/// Appends the stream recognised as retries of an already-stored event id.
pub static EVENTS_DUPLICATE: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(
        IntCounterVec::new(
            Opts::new(
                "engram_events_duplicate_total",
                "appends acknowledged as duplicates of a stored event id",
            ),
            &["layer"],
        )
        .unwrap(),
    )
});

/// Failed appends, by error kind (invalid, too_large, conflict, unavailable, rejected).
pub static APPEND_ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(
        IntCounterVec::new(
            Opts::new(
                "engram_append_errors_total",
                "appends that failed, by error kind",
            ),
            &["kind"],
        )
        .unwrap(),
    )
});

/// From publish to ack, per attempt.
pub static APPEND_LATENCY: LazyLock<HistogramVec> = LazyLock::new(|| {
    register(
        HistogramVec::new(
            HistogramOpts::new(
                "engram_append_latency_seconds",
                "time from publish to stream acknowledgement",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0,
            ]),
            &["outcome"],
        )
        .unwrap(),
    )
});

/// Events delivered by replay and tail, and those that failed to decode.
pub static EVENTS_READ: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(
        IntCounterVec::new(
            Opts::new(
                "engram_events_read_total",
                "events delivered to replay and tail readers, by outcome (ok, undecodable, subject_mismatch: published on another scope's subject, forged_dedup_key: its Nats-Msg-Id names another tenant, forged_source: a leaf delivered it outside its source's filter)",
            ),
            &["mode", "outcome"],
        )
        .unwrap(),
    )
});

/// The scope reads of replay pages (`engram.q.replay`, and so `/v1/tail`), one per scope
/// of a page, by result: `events` (a direct-get batch returned some), `empty` (a batch
/// found none of the scope's) and `skipped` (the stream held nothing after the page's
/// start, so nothing was read). An idle tail's foreign writes show as `empty`, at most one
/// per scope per page, never as a consumer.
pub static REPLAY_SCOPE_READS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_replay_scope_reads_total",
        "scope reads of replay pages, by result (events, empty, skipped)",
        &["result"],
    )
});

/// 1 while the process holds a live NATS connection.
pub static NATS_CONNECTED: LazyLock<IntGauge> = LazyLock::new(|| {
    register(IntGauge::new("engram_nats_connected", "1 if the nats connection is up").unwrap())
});

/// Handshakes the server refused and that were tried again, in case a config reload raced
/// them (see `engram_bus::Bus::connect`); a steady rise means a key really is refused.
pub static NATS_CONNECT_REFUSED_RETRIES: LazyLock<IntCounter> = LazyLock::new(|| {
    register(
        IntCounter::new(
            "engram_nats_connect_refused_retries_total",
            "nats handshakes refused as unauthorized and tried again",
        )
        .unwrap(),
    )
});

/// Projector consumers reopened because deliveries never arrived (a consumer leader of a
/// cluster died with them in flight): each is a loss avoided, and a sign of leader churn.
pub static CONSUMER_GAPS: LazyLock<IntCounter> = LazyLock::new(|| {
    register(
        IntCounter::new(
            "engram_consumer_delivery_gaps_total",
            "projector consumers reopened because deliveries were skipped",
        )
        .unwrap(),
    )
});

/// The Prometheus text exposition of every registered metric.
pub fn render() -> String {
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&REGISTRY.gather(), &mut out)
        .expect("text encoding of gathered metrics cannot fail");
    String::from_utf8(out).expect("prometheus text is utf-8")
}

/// State of the events stream as the server reports it, refreshed on every scrape.
pub static STREAM_MESSAGES: LazyLock<IntGauge> = LazyLock::new(|| {
    register(
        IntGauge::new(
            "engram_stream_messages",
            "events stored in the events stream",
        )
        .unwrap(),
    )
});
pub static STREAM_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    register(IntGauge::new("engram_stream_bytes", "bytes stored in the events stream").unwrap())
});
pub static STREAM_LAST_SEQ: LazyLock<IntGauge> = LazyLock::new(|| {
    register(
        IntGauge::new(
            "engram_stream_last_seq",
            "last sequence of the events stream",
        )
        .unwrap(),
    )
});
/// Times the events stream's leader was seen to move, by stream: the leader the server names
/// differs from the last one seen (an election in progress, with no leader, is no move).
/// Sampled by the process's health sampler every few seconds, so two moves between samples
/// count as one, and a move back and forth may count as none. A stream on one server counts
/// a restart of it when the server has no `server_name` (it comes back under a new one).
/// Each process that samples counts on its own: aggregate with `max by (stream)`, not `sum`.
pub static STREAM_LEADER_CHANGES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_stream_leader_changes_total",
        "times the stream's leader was seen to move to another server",
        &["stream"],
    )
});

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(IntCounterVec::new(Opts::new(name, help), labels).unwrap())
}

fn gauge(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register(IntGaugeVec::new(Opts::new(name, help), labels).unwrap())
}

fn histogram(name: &str, help: &str, labels: &[&str], buckets: Vec<f64>) -> HistogramVec {
    register(HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels).unwrap())
}

/// Events a projector applied to its read model (poison messages excluded).
pub static PROJECTOR_APPLIED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_projector_applied_total",
        "events applied to a read model",
        &["projector"],
    )
});
/// Poison messages: recorded in the dead-letter stream, acked and skipped.
pub static PROJECTOR_DEAD_LETTERED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_projector_dead_lettered_total",
        "events a projector could not apply and dead-lettered",
        &["projector"],
    )
});
/// Memories withdrawn from a read model by `forgotten` events.
pub static PROJECTOR_FORGOTTEN: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_projector_forgotten_total",
        "memories a forgotten event withdrew from a read model",
        &["projector"],
    )
});
/// Transient projector failures (bus, embedder, disk), by kind; the batch is retried.
pub static PROJECTOR_ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_projector_errors_total",
        "projector failures that were retried",
        &["projector", "kind"],
    )
});
/// Events in the stream that the projector has not applied yet.
pub static PROJECTOR_LAG: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    gauge(
        "engram_projector_lag_events",
        "stream events not yet applied by the projector",
        &["projector"],
    )
});
/// Consolidation outputs, by what happened to them.
pub static CONSOLIDATION_OUTPUTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_consolidation_outputs_total",
        "consolidation events planned by scheduled runs and appended",
        &["outcome"],
    )
});
/// Stream partitions this memory node owns (holds the lease of), caught up or not.
pub static NODE_PARTITIONS_OWNED: LazyLock<IntGauge> = LazyLock::new(|| {
    register(
        IntGauge::new(
            "engram_node_partitions_owned",
            "stream partitions whose lease this memory node holds",
        )
        .unwrap(),
    )
});

/// 1 for each partition whose lease this memory node holds; the series is removed when the
/// node lets the partition go, so a deployment has one series per owned partition and
/// `count by (partition)` is its number of owners. Process-wide, like every metric: right
/// for one node per process, which is how nodes run (`engram up`, `engram node`).
pub static NODE_PARTITION_OWNED: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    gauge(
        "engram_node_partition_owned",
        "1 for each stream partition whose lease this memory node holds",
        &["partition"],
    )
});

/// Partitions that came to this node (`in`), that it handed to another (`out`), and that it
/// lost without handing over (`lost`: its lease expired or was taken).
pub static NODE_PARTITION_MOVES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_node_partition_moves_total",
        "partitions taken over, handed over and lost by this memory node",
        &["direction"],
    )
});

/// From taking a partition's lease to answering its queries (its newest snapshot loaded and
/// the tail applied): how long a move keeps the partition unavailable here.
pub static NODE_TAKEOVER_SECONDS: LazyLock<prometheus::Histogram> = LazyLock::new(|| {
    register(
        prometheus::Histogram::with_opts(
            HistogramOpts::new(
                "engram_node_takeover_seconds",
                "time from taking a partition's lease to answering its queries",
            )
            .buckets(vec![
                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
            ]),
        )
        .unwrap(),
    )
});

/// Consolidation partitions whose lease this process holds.
pub static CONSOLIDATION_PARTITIONS_HELD: LazyLock<IntGauge> = LazyLock::new(|| {
    register(
        IntGauge::new(
            "engram_consolidation_partitions_held",
            "consolidation partitions whose lease this process holds",
        )
        .unwrap(),
    )
});
/// Session summaries the configured summariser failed to write, by reason (timeout,
/// unreachable, http, bad_response, empty): each kept its extractive summary.
pub static CONSOLIDATION_SUMMARISER_FAILURES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_consolidation_summariser_failures_total",
        "session summaries the summariser failed to write, which kept the extractive summary, by reason",
        &["reason"],
    )
});
/// The consolidator's requests to the vector model for close pairs (dedup candidates), by
/// outcome (ok, failed) and the pairs they returned: a failed one leaves dedup to MinHash
/// for that run, and is asked again the next.
pub static CONSOLIDATION_NEIGHBOUR_REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_consolidation_neighbour_requests_total",
        "requests to the vector model for close pairs of memories (dedup candidates), by outcome",
        &["outcome"],
    )
});
pub static CONSOLIDATION_NEIGHBOUR_PAIRS: LazyLock<prometheus::IntCounter> = LazyLock::new(|| {
    register(
        prometheus::IntCounter::new(
            "engram_consolidation_neighbour_pairs_total",
            "close pairs of memories the vector model offered dedup",
        )
        .expect("valid metric"),
    )
});
/// Secrets redacted before they were persisted, by kind and where: `sdk` (an SDK or CLI
/// write), `projector` (a raw event, redacted in the read models) or `dead_letter` (the
/// copy a projector dead-lettered).
pub static SCRUB_REDACTIONS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_scrub_redactions_total",
        "secrets redacted before they were persisted, by kind and where (sdk, projector, dead_letter)",
        &["kind", "at"],
    )
});
/// Authorization reloads of the nats-server after the access registry changed, by outcome
/// (`ok`, `error`).
pub static ACCESS_RELOADS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_access_reloads_total",
        "nats-server authorization reloads after an access registry change, by outcome",
        &["outcome"],
    )
});
/// From an access record being folded to the server confirming the reload that enforces it:
/// how long a revoked key can still connect.
pub static ACCESS_ENFORCE_SECONDS: LazyLock<prometheus::Histogram> = LazyLock::new(|| {
    register(
        prometheus::Histogram::with_opts(
            HistogramOpts::new(
                "engram_access_enforce_seconds",
                "time from an access record being read to the server enforcing it",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )
        .expect("valid metric"),
    )
});
/// Requests a service dropped unanswered and undone because their reply subject was not
/// the caller's own inbox (or they had none), by operation: a confused-deputy attempt, or a
/// client that does not set its inbox prefix.
pub static RPC_REPLIES_REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_rpc_replies_refused_total",
        "requests dropped because their reply subject is not the caller's inbox, by operation",
        &["op"],
    )
});
/// HTTP API errors, by stable code (`invalid`, `unauthenticated`, `forbidden`, `too_large`,
/// `rate_limited`, ...).
pub static GATEWAY_ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_gateway_errors_total",
        "HTTP API requests answered with an error, by code",
        &["code"],
    )
});
/// MCP tool calls (`engram mcp`, `/mcp`), by tool and outcome: `ok`, or `error` (a tool
/// error the model is shown: bad arguments, a refused scope, Engram unavailable).
pub static MCP_TOOL_CALLS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_mcp_tool_calls_total",
        "MCP tool calls, by tool and outcome",
        &["tool", "outcome"],
    )
});
/// MCP tool call latency, by tool, including read-your-writes waits.
pub static MCP_TOOL_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "engram_mcp_tool_seconds",
        "MCP tool call latency, by tool",
        &["tool"],
        prometheus::exponential_buckets(0.0005, 2.0, 16).unwrap(),
    )
});
/// Queries refused because the caller's identity may not read a scope it asked for.
pub static ACCESS_DENIED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_access_denied_total",
        "agent requests refused by the scope check, by reason (tenant, scope, revoked)",
        &["reason"],
    )
});
/// Time of one scheduled consolidation run over every scope (plan and append).
pub static CONSOLIDATION_SECONDS: LazyLock<prometheus::Histogram> = LazyLock::new(|| {
    register(
        prometheus::Histogram::with_opts(
            HistogramOpts::new(
                "engram_consolidation_run_seconds",
                "time of one scheduled consolidation run",
            )
            .buckets(vec![
                0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0,
            ]),
        )
        .unwrap(),
    )
});
/// Time to cut and store one snapshot (export, upload, index, retention).
pub static SNAPSHOT_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "engram_snapshot_seconds",
        "time to cut and store a read-model snapshot",
        &["projector"],
        vec![
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
        ],
    )
});
/// Size of the newest snapshot of each projector.
pub static SNAPSHOT_BYTES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    gauge(
        "engram_snapshot_bytes",
        "size of the newest read-model snapshot",
        &["projector"],
    )
});
/// When the newest snapshot of each instance hosted here was cut (Unix seconds, from the
/// snapshot index), and the stream sequence it holds everything up to: set from the index
/// when the instance starts (the snapshot it loads, or would load had it less of its own) and
/// whenever it cuts one. `time() - …` is its age, and `engram_stream_last_seq -
/// engram_snapshot_last_seq` the events a takeover would replay after it. An instance with no
/// snapshot has no series (a zero would read as one cut in 1970); the series go when the
/// instance's partition leaves the process.
pub static SNAPSHOT_LAST_TIMESTAMP: LazyLock<GaugeVec> = LazyLock::new(|| {
    register(
        GaugeVec::new(
            Opts::new(
                "engram_snapshot_last_timestamp_seconds",
                "when the newest snapshot of the read-model instance was cut, in unix seconds",
            ),
            &["projector"],
        )
        .unwrap(),
    )
});
pub static SNAPSHOT_LAST_SEQ: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    gauge(
        "engram_snapshot_last_seq",
        "stream sequence the newest snapshot of the read-model instance holds everything up to",
        &["projector"],
    )
});
/// Dead letters given up after repeated failures to store them (the dead-letter stream gone
/// and not recreatable, full, or refusing): the event was skipped without a record in
/// `ENGRAM_DLQ`, and is still in the events stream.
pub static PROJECTOR_DEAD_LETTERS_DROPPED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_projector_dead_letters_dropped_total",
        "poison events skipped without a dead letter, because the dead-letter stream did not take it",
        &["projector"],
    )
});
/// Keyword memories applied since the last commit, searched from the index's tail segment:
/// how much a crash would replay, and how much the tail costs each search.
pub static KEYWORD_TAIL_DOCS: LazyLock<IntGauge> = LazyLock::new(|| {
    register(
        IntGauge::new(
            "engram_keyword_tail_docs",
            "keyword memories searchable but not yet committed",
        )
        .unwrap(),
    )
});
/// The last sequence whose effects queries can see.
pub static PROJECTOR_VISIBLE_SEQ: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    gauge(
        "engram_projector_visible_seq",
        "last stream sequence visible to queries",
        &["projector"],
    )
});
/// From the stream storing an event to queries seeing it on an instance: written-to-readable,
/// what a `min_seq` query waits on. Observed for each event that becomes visible, of those
/// stored after the instance's loop started: a restart's or a takeover's backlog was written
/// before (and was often readable on another node), so its age would drown the steady state;
/// `engram_node_takeover_seconds` measures that wait. The stored time is the server's clock
/// and now is this process's: skew between them shifts every value (a negative one counts
/// as 0).
pub static PROJECTOR_VISIBILITY_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "engram_projector_visibility_seconds",
        "time from the stream storing an event to queries seeing it on the instance",
        &["projector"],
        // Up to a minute; 5 s is the default read-your-writes wait, which alerts compare with.
        vec![
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0,
        ],
    )
});
/// Messages an instance received that JetStream had delivered before (its delivery count
/// above 1): unacknowledged past the consumer's ack wait, or sent again by a new consumer
/// leader. The instance skips them by sequence; many mean it is slow to checkpoint and ack,
/// or its consumer's leader keeps changing.
pub static PROJECTOR_REDELIVERED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_projector_redelivered_total",
        "messages an instance received that jetstream had delivered before",
        &["projector"],
    )
});
pub static PROJECTOR_BATCH_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "engram_projector_batch_seconds",
        "time to apply and publish one batch",
        &["projector"],
        prometheus::exponential_buckets(0.0005, 2.0, 16).unwrap(),
    )
});
pub static PROJECTOR_CHECKPOINT_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "engram_projector_checkpoint_seconds",
        "time to persist a read model with its sequence",
        &["projector"],
        prometheus::exponential_buckets(0.001, 2.0, 16).unwrap(),
    )
});
/// Query service requests, by operation and outcome (ok, timeout, invalid, error).
pub static QUERIES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_queries_total",
        "query service requests",
        &["op", "outcome"],
    )
});
pub static QUERY_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "engram_query_seconds",
        "query service latency, including read-your-writes waits",
        &["op"],
        prometheus::exponential_buckets(0.0001, 2.0, 18).unwrap(),
    )
});
/// Where a retrieval's time goes inside the query service: `token` (refusing a
/// read-your-writes token no append returned), `keyword` and `vector` (each side's search of
/// the partitions asked, the read-your-writes wait included), `fuse` (ranking in the
/// service).
pub static RETRIEVE_STAGE_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "engram_retrieve_stage_seconds",
        "query service retrieval time by stage",
        &["stage"],
        prometheus::exponential_buckets(0.0001, 2.0, 18).unwrap(),
    )
});
/// Retrievals whose query named a date ("in July 2023", "yesterday"), so ranking lifted
/// the memories near it (`ranking.date_weight`). Against `engram_queries_total` it says how
/// often the lift applies.
pub static RETRIEVE_DATED: LazyLock<IntCounter> = LazyLock::new(|| {
    register(
        IntCounter::new(
            "engram_retrieve_dated_total",
            "retrievals whose query named a date that ranking lifted memories near",
        )
        .unwrap(),
    )
});

/// Retrieval-usage events (`feedback` with `retrieved`) the query service wrote, by
/// outcome: `appended`, `retried` (not acknowledged; kept to append again by the same id),
/// `dropped` (refused, or past the bound of events waiting to be appended).
pub static USAGE_EVENTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_query_usage_events_total",
        "retrieval-usage events the query service wrote, by outcome",
        &["outcome"],
    )
});
/// Memories returned by `retrieve` and `build_context`, one per memory per response:
/// `counted` for a usage event, or `dropped` past the bound of distinct memories held.
pub static USAGE_RETRIEVALS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_query_retrievals_counted_total",
        "memory returns the query service counted for retrieval usage, by outcome",
        &["outcome"],
    )
});
/// Embedding requests by source: cache hits, model calls, client-supplied vectors.
pub static EMBEDDINGS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_embeddings_total",
        "texts embedded, by where the vector came from",
        &["source"],
    )
});

/// 1 for each reason an embedder's last call failed for (auth, not_found, unreachable, ...),
/// 0 once it succeeds again: an embedding outage is visible here while events wait for it.
pub static EMBEDDER_FAILING: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    gauge(
        "engram_embedder_failing",
        "embedders whose last call failed, by reason; events wait until it succeeds",
        &["reason"],
    )
});
/// Failed embedder calls, by reason.
pub static EMBEDDER_FAILURES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_embedder_failures_total",
        "embedder calls that failed, by reason",
        &["reason"],
    )
});

/// Events a leaf node's relay handled, by direction (up: the leaf's own events to its
/// outbox; down: the hub's events from the inbox into the leaf's events stream) and outcome
/// (sent; echo: an event that went up from this leaf coming back; not_local: an event that
/// came from elsewhere, never sent up again; invalid: no event subject or id; failed).
pub static LEAF_RELAYED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_leaf_relayed_total",
        "events a leaf's relay handled, by direction and outcome",
        &["direction", "outcome"],
    )
});

/// Events a leaf has not relayed yet, by direction: the relay consumer's pending count.
pub static LEAF_PENDING: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(
        IntGaugeVec::new(
            Opts::new(
                "engram_leaf_pending",
                "events waiting for a leaf's relay, by direction",
            ),
            &["direction"],
        )
        .unwrap(),
    )
});

/// Whether the leaf's link to its hub is up (1) as its sources last reported.
pub static LEAF_LINK_UP: LazyLock<IntGauge> = LazyLock::new(|| {
    register(
        IntGauge::new(
            "engram_leaf_link_up",
            "1 when the leaf's inbox sources saw the hub recently",
        )
        .unwrap(),
    )
});

/// Times a link side took its sources across the link out and put them back (a link that
/// came back), by side (`leaf`, `hub`) and outcome (`ok`, `failed`, `deferred`: the link
/// came back sooner than the floor between two resumes allows, so it waits for it).
pub static LEAF_SOURCE_RESUMES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_leaf_source_resumes_total",
        "times the sources across a leaf link were resumed, by side and outcome",
        &["side", "outcome"],
    )
});

/// Leaf connections the hub closed because what a leaf may do changed (a leaf revoked, a
/// grant added or taken back): nats-server sets a leaf connection's permissions when it
/// connects and never re-checks it, so it is made to connect again.
pub static LEAF_CONNECTIONS_CLOSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "engram_leaf_connections_closed_total",
        "leaf connections the hub closed so that changed permissions apply, by outcome",
        &["outcome"],
    )
});

/// Creates a leaf's series up front.
pub fn touch_leaf() {
    for outcome in ["ok", "failed"] {
        LEAF_CONNECTIONS_CLOSED.with_label_values(&[outcome]);
    }
    for side in ["leaf", "hub"] {
        for outcome in ["ok", "failed", "deferred"] {
            LEAF_SOURCE_RESUMES.with_label_values(&[side, outcome]);
        }
    }
    for direction in ["up", "down"] {
        for outcome in ["sent", "echo", "not_local", "invalid", "failed"] {
            LEAF_RELAYED.with_label_values(&[direction, outcome]);
        }
        LEAF_PENDING.with_label_values(&[direction]);
    }
    LazyLock::force(&LEAF_LINK_UP);
}

/// Creates a projector's series up front (see [`touch_all`]). Not its snapshot gauges (an
/// instance with no snapshot has none: [`SNAPSHOT_LAST_TIMESTAMP`]) nor its histograms, which
/// appear at their first observation like every histogram here.
pub fn touch_projector(projector: &str) {
    PROJECTOR_APPLIED.with_label_values(&[projector]);
    PROJECTOR_DEAD_LETTERED.with_label_values(&[projector]);
    PROJECTOR_DEAD_LETTERS_DROPPED.with_label_values(&[projector]);
    PROJECTOR_FORGOTTEN.with_label_values(&[projector]);
    PROJECTOR_LAG.with_label_values(&[projector]);
    PROJECTOR_VISIBLE_SEQ.with_label_values(&[projector]);
    PROJECTOR_REDELIVERED.with_label_values(&[projector]);
    for kind in ["bus", "apply", "checkpoint", "publish"] {
        PROJECTOR_ERRORS.with_label_values(&[projector, kind]);
    }
}

/// Creates every series up front, zeros included, so that dashboards and alerts see them
/// before the first event rather than a gap. `layers` are the envelope's layer names.
pub fn touch_all(layers: &[&str]) {
    for layer in layers {
        EVENTS_APPENDED.with_label_values(&[layer]);
        EVENTS_DUPLICATE.with_label_values(&[layer]);
    }
    for kind in [
        "invalid",
        "too_large",
        "conflict",
        "unavailable",
        "rejected",
        "forbidden",
    ] {
        APPEND_ERRORS.with_label_values(&[kind]);
    }
    for outcome in ["ok", "duplicate", "error"] {
        APPEND_LATENCY.with_label_values(&[outcome]);
    }
    for mode in ["replay", "tail"] {
        for outcome in [
            "ok",
            "undecodable",
            "subject_mismatch",
            "forged_dedup_key",
            "forged_source",
        ] {
            EVENTS_READ.with_label_values(&[mode, outcome]);
        }
    }
    for result in ["events", "empty", "skipped"] {
        REPLAY_SCOPE_READS.with_label_values(&[result]);
    }
    for outcome in ["appended", "retried", "dropped"] {
        USAGE_EVENTS.with_label_values(&[outcome]);
    }
    for outcome in ["counted", "dropped"] {
        USAGE_RETRIEVALS.with_label_values(&[outcome]);
    }
    LazyLock::force(&NATS_CONNECTED);
    LazyLock::force(&ACCESS_EXPIRY_RENDERS);
    LazyLock::force(&CONSUMER_GAPS);
    LazyLock::force(&RETRIEVE_DATED);
    LazyLock::force(&NATS_CONNECT_REFUSED_RETRIES);
    LazyLock::force(&STREAM_MESSAGES);
    LazyLock::force(&STREAM_BYTES);
    LazyLock::force(&STREAM_LAST_SEQ);
}

/// Times the server's authorization was rendered again because a key's expiry passed
/// (`engram run`'s keys), with no record to prompt it.
pub static ACCESS_EXPIRY_RENDERS: LazyLock<IntCounter> = LazyLock::new(|| {
    register(
        IntCounter::new(
            "engram_access_expiry_renders_total",
            "authorization renders woken by a key's expiry",
        )
        .unwrap(),
    )
});

/// Sessions `engram run` started (its `started` record appended).
pub static SESSIONS_STARTED: LazyLock<IntCounter> = LazyLock::new(|| {
    register(
        IntCounter::new(
            "engram_sessions_started_total",
            "sessions engram run started",
        )
        .unwrap(),
    )
});

/// Sessions that ended, by outcome: `exited` (code 0), `failed` (another code),
/// `signalled`, or `unrecorded` (the `ended` record could not be appended: the session will
/// read as dead).
pub static SESSIONS_ENDED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(
        IntCounterVec::new(
            Opts::new(
                "engram_sessions_ended_total",
                "sessions that ended, by outcome",
            ),
            &["outcome"],
        )
        .unwrap(),
    )
});

/// Session records `engram run` appended or failed to, by step (started, heartbeat,
/// checkpoint, artifact, ended) and outcome (ok, error).
pub static SESSION_RECORDS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(
        IntCounterVec::new(
            Opts::new(
                "engram_session_records_total",
                "session records appended, by step and outcome",
            ),
            &["step", "outcome"],
        )
        .unwrap(),
    )
});

/// Requests on a session's socket refused before anything was written, by reason
/// (invalid, too_large, outside_workdir, not_a_file, not_found, too_many, busy, timeout).
pub static SESSION_REQUESTS_REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(
        IntCounterVec::new(
            Opts::new(
                "engram_session_requests_refused_total",
                "session socket requests refused, by reason",
            ),
            &["reason"],
        )
        .unwrap(),
    )
});

/// Bytes of artifacts stored in the Object Store and verified by hash.
pub static SESSION_ARTIFACT_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    register(
        IntCounter::new(
            "engram_session_artifact_bytes_total",
            "bytes of session artifacts stored and verified",
        )
        .unwrap(),
    )
});

/// Creates the session series up front, zeros included.
pub fn touch_sessions() {
    LazyLock::force(&SESSIONS_STARTED);
    LazyLock::force(&SESSION_ARTIFACT_BYTES);
    for outcome in ["exited", "failed", "signalled", "unrecorded"] {
        SESSIONS_ENDED.with_label_values(&[outcome]);
    }
    for step in ["started", "heartbeat", "checkpoint", "artifact", "ended"] {
        for outcome in ["ok", "error"] {
            SESSION_RECORDS.with_label_values(&[step, outcome]);
        }
    }
    for reason in [
        "invalid",
        "too_large",
        "outside_workdir",
        "not_a_file",
        "not_found",
        "too_many",
        "busy",
        "timeout",
    ] {
        SESSION_REQUESTS_REFUSED.with_label_values(&[reason]);
    }
}
