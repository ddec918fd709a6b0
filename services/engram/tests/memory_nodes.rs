//! Two memory nodes as real processes (`engram projector --partitions`), splitting the
//! stream's partitions between them. One is killed with SIGKILL while agents keep writing:
//! queries of its partitions are refused at once as unavailable while those of the other's
//! still answer, and once it is back every memory written meanwhile is found, each event
//! applied exactly once.

mod common;
use common::KillOnDrop;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use engram_fixtures::HashEmbedder;
use engram_memory::ScopeKey;
use engram_memory::proto::{Consistency, ErrorCode, RetrievalMode, RetrieveRequest, ScopeRequest};
use engram_projection_runtime::ApplyLedger;
use engram_schema::{Content, Embedding, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_sdk::{Client, RetryPolicy};
use engram_testkit::TestNats;
use tokio_util::sync::CancellationToken;

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");
const CONFIG: &str = r#"
[projectors]
checkpoint_interval = "300ms"

[projectors.embedder]
kind = "client_supplied"
model = "hash-32"
dim = 32
"#;
const SCOPES: usize = 16;
/// The read models a node runs here: all but the consolidator, which would write.
const MODELS: [&str; 5] = ["vector", "keyword", "facts", "skills", "docs"];

fn spawn(home: &std::path::Path, url: &str, partitions: &str) -> KillOnDrop {
    std::fs::create_dir_all(home).unwrap();
    std::fs::write(home.join("engram.toml"), CONFIG).unwrap();
    let child = Command::new(ENGRAM)
        .arg("--home")
        .arg(home)
        .arg("--config")
        .arg(home.join("engram.toml"))
        .args(["--log-format", "json", "--nats", url, "projector"])
        .args(MODELS)
        .args(["--partitions", partitions])
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_HOME")
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(home.join("node.log"))
                .unwrap(),
        )
        .spawn()
        .expect("spawn engram projector");
    KillOnDrop(child)
}

fn ident(s: &str) -> Ident {
    Ident::parse("id", s).unwrap()
}

fn scope(i: usize) -> Scope {
    Scope::new(ScopeKind::Team, &format!("team-{i}")).unwrap()
}

fn memory(n: usize) -> Envelope {
    let text = format!("memory {n} of team {} about the deploy", n % SCOPES);
    let mut e = Envelope::new(
        ident("acme"),
        scope(n % SCOPES),
        ident("agent-1"),
        ident("i-1"),
        Layer::Episodic,
        EventKind::Observation,
        Content::text(&text),
    );
    e.embedding = Some(Embedding {
        model: "hash-32".into(),
        vector: HashEmbedder::new(32).embed_one(&text),
    });
    e
}

fn everything(i: usize, min_seq: u64) -> RetrieveRequest {
    RetrieveRequest {
        scopes: ScopeRequest {
            tenant: ident("acme"),
            scope: scope(i),
            grants: vec![],
        },
        query: "the deploy".into(),
        vector: Some(HashEmbedder::new(32).embed_one("the deploy")),
        top_k: 1_000,
        filter: Default::default(),
        consistency: Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(30_000),
        },
        mode: RetrievalMode::Dense,
        ranking: None,
    }
}

/// The query service, in this process: it routes each request to the partitions' nodes.
async fn query_service(nats: &TestNats, stop: &CancellationToken) -> Client {
    let bus = nats.bus().await;
    let query = engram_query::Query::new(bus.clone(), engram_query::QueryConfig::default())
        .await
        .unwrap();
    let responder = nats.bus().await;
    query.serve(responder.client(), stop.clone()).await.unwrap();
    Client::from_bus(bus, RetryPolicy::default())
}

/// Until every partition of every model answers: the nodes are up.
async fn serving(bus: &engram_bus::Bus) {
    engram_testkit::wait_until(
        "every partition's instances",
        Duration::from_secs(60),
        || async {
            for model in MODELS {
                let status = engram_projectors::status_of(
                    bus.client(),
                    model,
                    bus.config().stream.partitions,
                    &Consistency::default(),
                    Duration::from_secs(5),
                )
                .await;
                if status.is_err() {
                    return false;
                }
            }
            true
        },
    )
    .await;
}

/// Every model's whole ledger once each partition has applied `min_seq`.
async fn ledgers(bus: &engram_bus::Bus, min_seq: u64) -> Vec<(&'static str, ApplyLedger)> {
    let mut out = Vec::new();
    for model in MODELS {
        let status = engram_projectors::status_of(
            bus.client(),
            model,
            bus.config().stream.partitions,
            &Consistency {
                min_seq: Some(min_seq),
                wait_ms: Some(30_000),
            },
            Duration::from_secs(40),
        )
        .await
        .unwrap_or_else(|e| panic!("{model}: {e}"));
        out.push((model, status.ledger));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_under_writes_loses_nothing_and_its_partitions_answer_once_it_is_back() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let stop = CancellationToken::new();
    let client = query_service(&nats, &stop).await;
    let homes = tempfile::tempdir().unwrap();
    let (home_a, home_b) = (homes.path().join("a"), homes.path().join("b"));
    let _a = spawn(&home_a, &nats.url(), "0-7");
    let mut b = spawn(&home_b, &nats.url(), "8-15");
    let partitions = bus.config().stream.partitions;
    let on_b = |i: usize| ScopeKey::new(ident("acme"), scope(i)).partition(partitions) >= 8;
    assert!((0..SCOPES).any(on_b) && !(0..SCOPES).all(on_b));

    // Given both nodes serving, every event is applied once by every model.
    serving(&bus).await;
    let mut written = Written::default();
    let first = written.append(&bus, 0..400).await;
    for (model, ledger) in ledgers(&bus, first).await {
        assert_eq!(ledger, written.ledger, "{model}");
    }

    // When node B is killed (SIGKILL) while it applies new writes, and agents keep
    // writing...
    written.append(&bus, 400..600).await;
    b.0.kill().unwrap();
    b.0.wait().unwrap();
    let second = written.append(&bus, 600..800).await;
    // ...then scopes on A's partitions answer with every memory, B's are refused at once.
    for i in 0..SCOPES {
        match found(&client, i, second).await {
            Ok(ids) if !on_b(i) => assert_eq!(ids, written.of(i), "team-{i}"),
            Err((code, message)) if on_b(i) => {
                assert_eq!(code, ErrorCode::Unavailable, "team-{i}: {message}");
                assert!(message.contains("partition"), "{message}");
            }
            other => panic!("team-{i} (on B: {}): {other:?}", on_b(i)),
        }
    }

    // And once B is back (from its own checkpoints), every scope answers with every memory,
    // each event applied once by every model across the kill.
    let _b = spawn(&home_b, &nats.url(), "8-15");
    serving(&bus).await;
    for (model, ledger) in ledgers(&bus, second).await {
        assert_eq!(ledger, written.ledger, "{model} after the kill");
    }
    for i in 0..SCOPES {
        assert_eq!(
            found(&client, i, second).await.unwrap(),
            written.of(i),
            "team-{i}"
        );
    }
    stop.cancel();
}

/// What the models must hold: each event once, and each scope's memories.
#[derive(Default)]
struct Written {
    ledger: ApplyLedger,
    ids: BTreeMap<usize, Vec<String>>,
}

impl Written {
    /// Appends memories `range`; the last sequence.
    async fn append(&mut self, bus: &engram_bus::Bus, range: std::ops::Range<usize>) -> u64 {
        let events: Vec<Envelope> = range.clone().map(memory).collect();
        let mut last = 0;
        for ((n, event), r) in range.zip(&events).zip(bus.append_batch(&events, 128).await) {
            let seq = r.unwrap().seq;
            self.ledger.add(seq, event.event_id.as_str());
            self.ids
                .entry(n % SCOPES)
                .or_default()
                .push(event.event_id.to_string());
            last = last.max(seq);
        }
        last
    }

    /// Scope `i`'s memories, sorted.
    fn of(&self, i: usize) -> Vec<String> {
        let mut ids = self.ids[&i].clone();
        ids.sort();
        ids
    }
}

/// The memories a dense retrieval of everything in scope `i` finds, sorted; or why not.
async fn found(
    client: &Client,
    i: usize,
    min_seq: u64,
) -> Result<Vec<String>, (ErrorCode, String)> {
    let mut ids: Vec<String> = client
        .retrieve(&everything(i, min_seq))
        .await
        .map_err(|e| (e.code(), e.to_string()))?
        .results
        .into_iter()
        .map(|r| r.event_id.to_string())
        .collect();
    ids.sort();
    Ok(ids)
}
