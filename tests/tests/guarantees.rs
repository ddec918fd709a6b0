//! Guarantees the README states that no other test checks, each against a real nats-server
//! and the real services: erasure refusing a stream that denies deletes, the access registry
//! refusing a stale admin's write, the HTTP API's tail and connection bounds, its batch
//! bound, the tail's resume without a gap, and the summariser's bound on calls at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use engram_access::{AccessError, AccessLog, Record, RoleName};
use engram_gateway::GatewayConfig;
use engram_memory::proto::{
    Consistency, ConsolidateRequest, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope};
use engram_testkit::TestNats;
use engram_tests::{Engram, projectors_config};
use serde_json::{Value, json};

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn scope(s: &str) -> Scope {
    s.parse().unwrap()
}

// ---------------------------------------------------------------------------------------
// 1. `engram erase` refuses a stream created with deny_delete / deny_purge, changing nothing.
// ---------------------------------------------------------------------------------------

/// A keyword retrieval of `user:u1` of acme at `min_seq`: what the read models still show.
async fn u1_memories(engram: &Engram, min_seq: u64) -> usize {
    engram
        .client
        .retrieve(&RetrieveRequest {
            scopes: ScopeRequest {
                tenant: ident("acme"),
                scope: scope("user:u1"),
                grants: vec![],
            },
            query: "billing".into(),
            vector: None,
            top_k: 50,
            filter: Default::default(),
            consistency: Consistency {
                min_seq: Some(min_seq),
                wait_ms: Some(20_000),
            },
            mode: RetrievalMode::Keyword,
            ranking: None,
        })
        .await
        .unwrap()
        .results
        .len()
}

/// The access registry's last sequence, read from its stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn erase_refuses_a_stream_that_denies_deletes_or_purges_and_changes_nothing() {
    let nats = TestNats::start_secured().await;
    let engram = Engram::start_secured(&nats).await;
    let mut last = 0;
    for i in 0..3 {
        let e = engram_tests::embedded(
            "acme",
            scope("user:u1"),
            "assistant",
            &format!("u1 note {i} about billing"),
        );
        last = engram.client.append(&e).await.unwrap().seq;
    }
    assert_eq!(u1_memories(&engram, last).await, 3);

    // An older engram made the stream with these flags; nats-server sets them on an update
    // (and never lifts them). deny_delete alone first: erasure deletes messages one by one.
    let name = nats.admin.config().stream.name.clone();
    let snapshots = engram_snapshots::SnapshotsConfig::default();
    for (deny_delete, deny_purge) in [(true, false), (true, true)] {
        engram_testkit::deny_erasure(&nats.admin, deny_delete, deny_purge).await;
        let messages = nats.admin.stream_summary().await.unwrap().messages;
        let registry = nats.registry_last_seq().await;

        let refused = engram
            .client
            .erase(&ident("acme"), &[scope("user:u1")], &snapshots, "test")
            .await;
        match refused {
            Err(engram_sdk::erase::EraseError::StreamDeniesErasure { stream }) => {
                assert_eq!(stream, name)
            }
            other => panic!(
                "deny_delete={deny_delete} deny_purge={deny_purge}: erase was not refused: {other:?}"
            ),
        }
        // Nothing was changed: no audit record, every event, every memory in the models.
        assert_eq!(
            nats.registry_last_seq().await,
            registry,
            "an audit record was appended"
        );
        assert_eq!(
            nats.admin.stream_summary().await.unwrap().messages,
            messages
        );
        assert_eq!(
            u1_memories(&engram, last).await,
            3,
            "a read model was erased"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 2. Registry appends are serialised by expected sequence: no admin acts on a stale view.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_admin_on_a_stale_view_of_the_registry_is_refused_and_nothing_is_written() {
    let nats = TestNats::start_secured().await;
    // The admins' connections, each its own, made before any registry change reloads the
    // server's authorization.
    let mut admins = Vec::new();
    for _ in 0..7 {
        admins.push(
            nats.connect_as(&nats.service(RoleName::Admin))
                .await
                .unwrap(),
        );
    }
    nats.add_tenant("acme").await;
    let creds = nats.add_agent("acme", "planner", &[]).await;
    // Two admins.
    let first = AccessLog::new(nats.admin.client().clone());
    let second_bus = admins.pop().unwrap();
    let second = AccessLog::new(second_bus.client().clone());
    let revoke = Record::AgentRevoked {
        tenant: ident("acme"),
        agent: ident("planner"),
        key: Some(creds.public_key()),
    };

    // Both read the registry: the key is live, so revoking it checks out for both.
    let view_one = first.load().await.unwrap();
    let view_two = second.load().await.unwrap();
    assert_eq!(view_one.applied, view_two.applied);
    view_two.check(&revoke).unwrap();
    let revoked = first
        .append_on(&view_one, revoke.clone(), "admin-1")
        .await
        .unwrap();
    // The second acts on its stale view: refused, typed, and the log did not grow.
    match second.append_on(&view_two, revoke.clone(), "admin-2").await {
        Err(AccessError::Stale { read }) => assert_eq!(read, view_two.applied),
        other => panic!("a write on a stale view was not refused: {other:?}"),
    }
    assert_eq!(nats.registry_last_seq().await, revoked);
    // Read again, the same change no longer fits: it is refused for what it is.
    match second.append(revoke.clone(), "admin-2").await {
        Err(AccessError::NoAgent { tenant, agent }) => {
            assert_eq!((tenant.as_str(), agent.as_str()), ("acme", "planner"))
        }
        other => panic!("revoking a revoked key was not refused: {other:?}"),
    }
    assert_eq!(nats.registry_last_seq().await, revoked);

    // Many admins adding one tenant at once: exactly one is stored, the others are told.
    let before = nats.registry_last_seq().await;
    let barrier = Arc::new(tokio::sync::Barrier::new(admins.len()));
    let tasks: Vec<_> = admins
        .iter()
        .enumerate()
        .map(|(i, bus)| {
            let log = AccessLog::new(bus.client().clone());
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                log.append(
                    Record::TenantAdded {
                        tenant: ident("globex"),
                    },
                    &format!("admin-{i}"),
                )
                .await
            })
        })
        .collect();
    let mut added = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(_) => added += 1,
            Err(AccessError::TenantExists { tenant }) => assert_eq!(tenant, "globex"),
            Err(e) => panic!("an admin failed otherwise: {e}"),
        }
    }
    assert_eq!(added, 1);
    assert_eq!(nats.registry_last_seq().await, before + 1);
}

// ---------------------------------------------------------------------------------------
// 3. The HTTP API's bounds: open tails per key and in all, and keys holding a connection.
// ---------------------------------------------------------------------------------------

async fn open_tail(base: &str, key: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(format!("{base}/v1/tail?scope=task:t1&after_seq=0"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
}

/// The answer of a refused tail: its status and error code.
async fn refusal(response: reqwest::Response) -> (u16, String) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    (
        status,
        body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn open_tails_are_bounded_per_key_and_in_all_and_a_closed_one_frees_its_slot() {
    let (nats, _engram, a) = engram_tests::secured_with_key("acme", "a").await;
    let b = nats.add_agent("acme", "b", &[]).await.api_key().unwrap();
    let base = engram_tests::serve_http(
        &nats,
        GatewayConfig {
            max_tails_per_key: 2,
            max_tails: 3,
            ..GatewayConfig::default()
        },
    )
    .await;
    // Within the bounds every tail opens.
    let mut a_tails = Vec::new();
    for _ in 0..2 {
        let tail = open_tail(&base, &a).await;
        assert_eq!(tail.status(), 200);
        a_tails.push(tail);
    }
    // One more of key a: past its own bound.
    assert_eq!(
        refusal(open_tail(&base, &a).await).await,
        (429, "rate_limited".to_owned())
    );
    // Key b may hold one: the third in all...
    let b_tail = open_tail(&base, &b).await;
    assert_eq!(b_tail.status(), 200);
    // ...and no second, though it holds fewer than its own bound: past the total.
    assert_eq!(
        refusal(open_tail(&base, &b).await).await,
        (429, "rate_limited".to_owned())
    );
    // A tail the client closed frees its slot ("close one first"), idle as it is.
    drop(a_tails.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    let reopened = loop {
        let tail = open_tail(&base, &a).await;
        if tail.status() == 200 {
            break tail;
        }
        assert_eq!(refusal(tail).await, (429, "rate_limited".to_owned()));
        assert!(
            std::time::Instant::now() < deadline,
            "the closed tail's slot was never freed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Full again.
    assert_eq!(
        refusal(open_tail(&base, &b).await).await,
        (429, "rate_limited".to_owned())
    );
    drop((reopened, a_tails, b_tail));
}

/// Established TCP connections of this machine to `port` on the loopback: the clients of
/// the test's nats-server (each test has its own server, on its own port).
fn connections_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("read /proc/net/tcp");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let remote_port = fields
                .get(2)
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            remote_port == Some(port) && fields.get(3) == Some(&"01")
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_most_max_identities_keys_hold_a_connection_and_an_evicted_key_still_works() {
    let (nats, _engram, a) = engram_tests::secured_with_key("acme", "a").await;
    let b = nats.add_agent("acme", "b", &[]).await.api_key().unwrap();
    let c = nats.add_agent("acme", "c", &[]).await.api_key().unwrap();
    let port: u16 = nats.url().rsplit_once(':').unwrap().1.parse().unwrap();
    let base = engram_tests::serve_http(
        &nats,
        GatewayConfig {
            max_identities: 2,
            ..GatewayConfig::default()
        },
    )
    .await;
    // Every connection of the services and the admin is open, and the keys' test
    // connections (the harness's checks that the server took them) are closed: the count
    // holds still for a second.
    let mut services = connections_to(port);
    let mut still_since = std::time::Instant::now();
    let deadline = still_since + Duration::from_secs(30);
    while still_since.elapsed() < Duration::from_secs(1) {
        assert!(
            std::time::Instant::now() < deadline,
            "the connections never settled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = connections_to(port);
        if now != services {
            (services, still_since) = (now, std::time::Instant::now());
        }
    }
    let settles_at = move |n: usize| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let now = connections_to(port);
            if now == services + n {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{now} connections to the server, not {services} of the services and {n} of the gateway"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // Within the bound each key connects and is served.
    for (key, agent, open) in [(&a, "a", 1), (&b, "b", 2)] {
        let (status, body) = engram_tests::get_json(&base, "/v1/whoami", key).await;
        assert_eq!(
            (status, body["agent"].as_str()),
            (200, Some(agent)),
            "{body}"
        );
        settles_at(open).await;
    }
    // A third key is served too, and the least recently used key's connection is closed.
    let (status, body) = engram_tests::get_json(&base, "/v1/whoami", &c).await;
    assert_eq!((status, body["agent"].as_str()), (200, Some("c")), "{body}");
    settles_at(2).await;
    // The evicted key reconnects on its next request; still two held.
    let (status, body) = engram_tests::get_json(&base, "/v1/whoami", &a).await;
    assert_eq!((status, body["agent"].as_str()), (200, Some("a")), "{body}");
    settles_at(2).await;
}

// ---------------------------------------------------------------------------------------
// 4. `POST /v1/events` takes at most 1000 events: more is refused whole, nothing stored.
// ---------------------------------------------------------------------------------------

fn observation(i: usize) -> Value {
    json!({
        "scope": {"kind": "task", "id": "t1"},
        "layer": "episodic",
        "kind": "observation",
        "content": {"text": format!("batch note {i}")},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn more_than_1000_events_in_one_request_are_refused_and_none_is_stored() {
    let (nats, _engram, key) = engram_tests::secured_with_key("acme", "planner").await;
    let base = engram_tests::serve_http(&nats, GatewayConfig::default()).await;
    let stored = || async { nats.admin.stream_summary().await.unwrap().messages };
    let before = stored().await;

    let too_many: Vec<Value> = (0..1001).map(observation).collect();
    let (status, body) =
        engram_tests::post_json(&base, "/v1/events", &key, &Value::Array(too_many)).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid")),
        "{body}"
    );
    assert!(
        body["error"]["message"].as_str().unwrap().contains("1000"),
        "{body}"
    );
    assert_eq!(stored().await, before, "part of a refused batch was stored");

    // Exactly 1000 are taken, each with its own seq, in order.
    let most: Vec<Value> = (0..1000).map(observation).collect();
    let (status, body) =
        engram_tests::post_json(&base, "/v1/events", &key, &Value::Array(most)).await;
    assert_eq!(status, 200, "{body}");
    let seqs: Vec<u64> = body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["seq"].as_u64().expect("every event has its seq"))
        .collect();
    assert_eq!(seqs.len(), 1000);
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert_eq!(stored().await, before + 1000);
}

// ---------------------------------------------------------------------------------------
// 5. The tail resumes with `Last-Event-ID` without a gap or a duplicate.
// ---------------------------------------------------------------------------------------

/// Server-Sent Events read from a response: each `memory` event's id (its seq) and text.
struct Sse {
    response: reqwest::Response,
    buffer: String,
}

impl Sse {
    fn new(response: reqwest::Response) -> Self {
        assert_eq!(response.status(), 200);
        Self {
            response,
            buffer: String::new(),
        }
    }

    /// The next `memory` event, within `timeout`; `None` if none came.
    async fn next(&mut self, timeout: Duration) -> Option<(u64, String)> {
        tokio::time::timeout(timeout, async {
            loop {
                while let Some(end) = self.buffer.find("\n\n") {
                    let block: String = self.buffer.drain(..end + 2).collect();
                    let (mut id, mut kind, mut data) = (None, None, None);
                    for line in block.lines() {
                        if let Some(v) = line.strip_prefix("id:") {
                            id = Some(v.trim().parse::<u64>().unwrap());
                        } else if let Some(v) = line.strip_prefix("event:") {
                            kind = Some(v.trim().to_owned());
                        } else if let Some(v) = line.strip_prefix("data:") {
                            data = Some(serde_json::from_str::<Value>(v.trim()).unwrap());
                        }
                    }
                    match kind.as_deref() {
                        Some("memory") => {
                            let data = data.expect("a memory event has data");
                            let id = id.expect("a memory event has an id");
                            assert_eq!(data["seq"].as_u64(), Some(id), "{data}");
                            let text = data["event"]["content"]["text"]
                                .as_str()
                                .unwrap_or_default()
                                .to_owned();
                            return (id, text);
                        }
                        Some(other) => panic!("the tail sent {other}: {data:?}"),
                        None => {} // a keep-alive comment
                    }
                }
                let chunk = self
                    .response
                    .chunk()
                    .await
                    .unwrap()
                    .expect("the tail ended");
                self.buffer.push_str(&String::from_utf8_lossy(&chunk));
            }
        })
        .await
        .ok()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tail_resumed_with_last_event_id_misses_nothing_and_repeats_nothing() {
    let (nats, _engram, key) = engram_tests::secured_with_key("acme", "planner").await;
    let base = engram_tests::serve_http(&nats, GatewayConfig::default()).await;
    let mut appended = Vec::new();
    let append = |i: usize| {
        let (base, key) = (base.clone(), key.clone());
        async move {
            let (status, body) =
                engram_tests::post_json(&base, "/v1/events", &key, &observation(i)).await;
            assert_eq!(status, 200, "{body}");
            body["results"][0]["seq"].as_u64().unwrap()
        }
    };
    for i in 0..4 {
        appended.push(append(i).await);
    }
    let url = format!("{base}/v1/tail?scope=task:t1&after_seq=0");
    let client = reqwest::Client::new();
    // Read two of the four, then go away.
    let mut first = Sse::new(client.get(&url).bearer_auth(&key).send().await.unwrap());
    let mut read = Vec::new();
    for _ in 0..2 {
        read.push(first.next(Duration::from_secs(30)).await.expect("an event"));
    }
    drop(first);
    let last_seen = read[1].0;
    assert_eq!(
        read.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        appended[..2]
    );
    // Written while no tail was open.
    for i in 4..7 {
        appended.push(append(i).await);
    }
    // Reconnected as an EventSource does: the same URL, with the last id it saw.
    let mut resumed = Sse::new(
        client
            .get(&url)
            .bearer_auth(&key)
            .header("Last-Event-ID", last_seen.to_string())
            .send()
            .await
            .unwrap(),
    );
    let mut after = Vec::new();
    for _ in 2..7 {
        after.push(
            resumed
                .next(Duration::from_secs(30))
                .await
                .expect("an event"),
        );
    }
    // One written live, after the resume: the next event is exactly it, so nothing was
    // sent twice in between.
    appended.push(append(7).await);
    after.push(
        resumed
            .next(Duration::from_secs(30))
            .await
            .expect("the live event"),
    );
    assert_eq!(
        after.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        appended[2..],
        "{after:?}"
    );
    let texts: Vec<String> = (2..8).map(|i| format!("batch note {i}")).collect();
    assert_eq!(after.into_iter().map(|(_, t)| t).collect::<Vec<_>>(), texts);
}

// ---------------------------------------------------------------------------------------
// 6. The summariser: at most 2 calls at once, across every plan of the consolidator.
// ---------------------------------------------------------------------------------------

/// An OpenAI-compatible chat endpoint that counts the calls it is in, and holds each one
/// until a second call is in as well (or 5 s pass), then a moment more, so that calls a
/// bound would not hold back are in at the same time.
#[derive(Default)]
struct Llm {
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    calls: AtomicUsize,
    paired: tokio::sync::Notify,
}

async fn completions(
    axum::extract::State(llm): axum::extract::State<Arc<Llm>>,
    axum::Json(body): axum::Json<Value>,
) -> axum::Json<Value> {
    llm.calls.fetch_add(1, Ordering::SeqCst);
    let now = llm.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    llm.max_in_flight.fetch_max(now, Ordering::SeqCst);
    llm.paired.notify_waiters();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let notified = llm.paired.notified();
            if llm.max_in_flight.load(Ordering::SeqCst) >= 2 {
                return;
            }
            notified.await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    llm.in_flight.fetch_sub(1, Ordering::SeqCst);
    let user = body["messages"][1]["content"].as_str().unwrap_or_default();
    let head: String = user.chars().take(30).collect();
    let content = json!({"summary": format!("llm: {head}"), "facts": []}).to_string();
    axum::Json(json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }))
}

fn session_event(scope: &Scope, text: &str) -> Envelope {
    Envelope::new(
        ident("acme"),
        scope.clone(),
        ident("agent-1"),
        ident("i-1"),
        Layer::Episodic,
        EventKind::Observation,
        Content::text(text),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_summariser_is_asked_at_most_two_calls_at_once() {
    let llm = Arc::new(Llm::default());
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(completions))
        .with_state(llm.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let nats = TestNats::start().await;
    let mut config = projectors_config();
    // On demand only: the plans below are all there is.
    config.consolidator.interval = Duration::ZERO;
    config.consolidator.summariser = engram_consolidate::summariser::SummariserConfig::OpenAi(
        engram_consolidate::summariser::OpenAiConfig {
            url,
            model: "tiny".into(),
            api_key_env: None,
            timeout: Duration::from_secs(30),
            max_tokens: 256,
            max_input_bytes: 32 * 1024,
            candidate_confidence: 0.5,
        },
    );
    let engram = Engram::start_with(&nats, config, engram_query::QueryConfig::default()).await;
    // Three scopes with 3, 2 and 2 finished sessions: 7 summaries to write, of which one
    // plan alone would have 2 in flight at once, and the three plans together 6.
    let sessions = [("team:a", 3), ("team:b", 2), ("team:c", 2)];
    let mut last = 0;
    for (name, n) in sessions {
        let s = scope(name);
        for session in 0..n {
            for line in 0..2 {
                let text = format!("{name} session {session} found fact {line} in the logs.");
                engram
                    .client
                    .append(&session_event(&s, &text))
                    .await
                    .unwrap();
            }
            let mut finished = session_event(&s, "");
            finished.layer = Layer::Working;
            finished.kind = EventKind::Checkpoint;
            finished.content.data = Some(json!({"finished": true}));
            last = engram.client.append(&finished).await.unwrap().seq;
        }
    }
    let plans = futures::future::join_all(sessions.iter().map(|(name, _)| {
        let client = engram.client.clone();
        let request = ConsolidateRequest {
            scopes: ScopeRequest {
                tenant: ident("acme"),
                scope: scope(name),
                grants: vec![],
            },
            steps: vec!["summarise".into()],
            restore: vec![],
            apply: false,
            consistency: Consistency {
                min_seq: Some(last),
                wait_ms: Some(20_000),
            },
        };
        async move { client.consolidation_plan(&request).await.unwrap() }
    }))
    .await;
    // Every summary was written by the model (none fell back for lack of time)...
    for ((name, n), plan) in sessions.iter().zip(&plans) {
        let summaries: Vec<&str> = plan
            .events
            .iter()
            .filter(|e| e.kind == EventKind::Consolidated)
            .map(|e| e.content.text.as_str())
            .collect();
        assert_eq!(summaries.len(), *n, "{name}: {summaries:?}");
        assert!(
            summaries.iter().all(|t| t.starts_with("llm: ")),
            "{name}: {summaries:?}"
        );
    }
    // ...and never more than two were asked at once.
    assert_eq!(llm.calls.load(Ordering::SeqCst), 7);
    assert_eq!(llm.max_in_flight.load(Ordering::SeqCst), 2);
    drop(engram);
}
