//! Memory nodes as real processes (`engram node`), owning the stream's partitions by lease
//! on one secured server. Nodes joining take their share from the others, a node killed with
//! SIGKILL under writes has its partitions taken over by the survivors (each from its newest
//! snapshot plus the tail), and an agent's query about its own scope reaches the owning node
//! through the server's routing in one request. Across every move, every memory is found and
//! every model's apply ledger equals the stream's: no event lost, none applied twice.

mod common;
use common::KillOnDrop;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use engram_fixtures::HashEmbedder;
use engram_memory::ScopeKey;
use engram_memory::proto::{Consistency, RetrievalMode, RetrieveRequest, ScopeRequest};
use engram_projection_runtime::ApplyLedger;
use engram_schema::{Content, Embedding, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_sdk::{Client, RetryPolicy};
use engram_testkit::{SecureNats, TestNats};

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");
/// Short leases, so a killed node's partitions move within seconds; snapshots cut often, so
/// a node taking a partition over starts from one.
const CONFIG: &str = r#"
[projectors]
run = ["vector", "keyword", "facts", "skills", "docs"]
checkpoint_interval = "300ms"

[projectors.snapshots]
interval = "1s"
min_events = 20

[projectors.embedder]
kind = "client_supplied"
model = "hash-32"
dim = 32

[node]
lease_ttl = "3s"
"#;
const LEASE_TTL: Duration = Duration::from_secs(3);
const SCOPES: usize = 24;
const MODELS: [&str; 5] = ["vector", "keyword", "facts", "skills", "docs"];

fn ident(s: &str) -> Ident {
    Ident::parse("id", s).unwrap()
}

fn scope(i: usize) -> Scope {
    Scope::new(ScopeKind::Task, &format!("t-{i}")).unwrap()
}

/// Starts `engram node` number `i`, its state in `<dir>/<i>`.
fn spawn(nats: &SecureNats, dir: &std::path::Path, i: usize) -> KillOnDrop {
    let state = dir.join(i.to_string());
    std::fs::create_dir_all(&state).unwrap();
    let config = dir.join("engram.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let child = Command::new(ENGRAM)
        .arg("--home")
        .arg(&nats.home)
        .arg("--config")
        .arg(&config)
        .args(["--log-format", "json", "--nats", &nats.url(), "node"])
        .arg("--state-dir")
        .arg(&state)
        .args(["--name", &format!("n{i}")])
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_HOME")
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(state.join("node.log"))
                .unwrap(),
        )
        .spawn()
        .expect("spawn engram node");
    KillOnDrop(child)
}

/// Each live node's partitions, as the nodes announce them.
async fn serving(bus: &engram_bus::Bus) -> BTreeMap<String, BTreeSet<u32>> {
    engram_node::ownership::live_members(bus, "ENGRAM_NODES")
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|m| (m.node, m.serving.into_iter().collect()))
        .collect()
}

/// Waits until the named nodes serve exactly their shares: each partition the one the
/// assignment over them gives it; returns how long that took and each one's share.
async fn settle(
    bus: &engram_bus::Bus,
    nodes: &[&str],
    within: Duration,
) -> (Duration, BTreeMap<String, BTreeSet<u32>>) {
    let started = Instant::now();
    let partitions = bus.config().stream.partitions;
    let members: Vec<(String, engram_projectors::PartitionSet)> = nodes
        .iter()
        .map(|n| ((*n).to_owned(), engram_projectors::PartitionSet::all()))
        .collect();
    let mut wanted: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    for (p, owner) in engram_node::ownership::assign(partitions, &members)
        .into_iter()
        .enumerate()
    {
        wanted.entry(owner.unwrap()).or_default().insert(p as u32);
    }
    loop {
        let mut now = serving(bus).await;
        now.retain(|_, s| !s.is_empty());
        if now == wanted {
            return (started.elapsed(), now);
        }
        assert!(
            started.elapsed() < within,
            "nodes {nodes:?} did not settle within {within:?}: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn memory(n: usize) -> Envelope {
    let text = format!("memory {n} of task {} about the deploy", n % SCOPES);
    let mut e = Envelope::new(
        ident("acme"),
        scope(n % SCOPES),
        ident("planner"),
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

/// What the models must hold: each event once, and each scope's memories.
#[derive(Default)]
struct Written {
    ledger: ApplyLedger,
    ids: BTreeMap<usize, BTreeSet<String>>,
    last: u64,
}

impl Written {
    async fn append(&mut self, bus: &engram_bus::Bus, range: std::ops::Range<usize>) -> u64 {
        let events: Vec<Envelope> = range.clone().map(memory).collect();
        for ((n, event), r) in range.zip(&events).zip(bus.append_batch(&events, 128).await) {
            let seq = r.unwrap().seq;
            self.ledger.add(seq, event.event_id.as_str());
            self.ids
                .entry(n % SCOPES)
                .or_default()
                .insert(event.event_id.to_string());
            self.last = self.last.max(seq);
        }
        self.last
    }
}

/// The memories an agent's dense retrieval of everything in task `i` finds, or why not.
async fn found(agent: &Client, i: usize, min_seq: u64) -> Result<BTreeSet<String>, String> {
    let request = RetrieveRequest {
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
    };
    agent
        .retrieve(&request)
        .await
        .map(|r| {
            r.results
                .into_iter()
                .map(|m| m.event_id.to_string())
                .collect()
        })
        .map_err(|e| format!("{:?}: {e}", e.code()))
}

/// Every model's whole ledger once each partition has applied `min_seq`, from whichever
/// node owns it.
async fn ledgers(bus: &engram_bus::Bus, min_seq: u64) -> Vec<(&'static str, ApplyLedger)> {
    let mut out = Vec::new();
    for model in MODELS {
        let status = engram_projectors::ledger_of(
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

/// Every task's memories, found by the agent through its routed queries.
async fn finds_everything(agent: &Client, written: &Written) {
    for i in 0..SCOPES {
        let found = found(agent, i, written.last).await;
        assert_eq!(found.as_ref(), Ok(&written.ids[&i]), "task t-{i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_share_partitions_hand_them_over_on_join_and_take_a_killed_ones_over() {
    let nats = TestNats::start_secured().await;
    nats.add_tenant("acme").await;
    let creds = nats.add_agent("acme", "planner", &["task:*"]).await;
    let agent = Client::from_bus(
        nats.connect_as(&creds).await.unwrap(),
        RetryPolicy::default(),
    );
    let bus = nats.admin.clone();
    let dir = tempfile::tempdir().unwrap();
    let mut written = Written::default();
    written.append(&bus, 0..300).await;

    // Given one node, it owns every partition and every memory is found.
    let n0 = spawn(&nats, dir.path(), 0);
    settle(&bus, &["n0"], Duration::from_secs(60)).await;
    finds_everything(&agent, &written).await;

    // When two more join, under writes, they take their share from it...
    written.append(&bus, 300..400).await;
    let n1 = spawn(&nats, dir.path(), 1);
    let mut n2 = spawn(&nats, dir.path(), 2);
    written.append(&bus, 400..500).await;
    let (joined, shares) = settle(&bus, &["n0", "n1", "n2"], Duration::from_secs(60)).await;
    eprintln!("three nodes serve every partition {joined:?} after the joins: {shares:?}");
    // ...each partition served by one node, answering every query as one node did, and
    // every event applied once by every model.
    finds_everything(&agent, &written).await;
    for (model, ledger) in ledgers(&bus, written.last).await {
        assert_eq!(ledger, written.ledger, "{model} after the joins");
    }

    // When one is killed (SIGKILL) while agents keep writing...
    let killed: BTreeSet<u32> = shares["n2"].clone();
    written.append(&bus, 500..600).await;
    let killed_at = Instant::now();
    n2.0.kill().unwrap();
    n2.0.wait().unwrap();
    written.append(&bus, 600..700).await;
    // ...the others take its partitions over once its leases expire, and every memory
    // written before and after the kill is found again.
    let (took, shares) = settle(&bus, &["n0", "n1"], Duration::from_secs(60)).await;
    let since_kill = killed_at.elapsed();
    eprintln!(
        "partitions {killed:?} of the killed node served again {since_kill:?} after the kill ({took:?} after the last write): {shares:?}"
    );
    assert!(
        since_kill < LEASE_TTL * 10,
        "the takeover took {since_kill:?}"
    );
    finds_everything(&agent, &written).await;
    for (model, ledger) in ledgers(&bus, written.last).await {
        assert_eq!(ledger, written.ledger, "{model} after the kill");
    }
    // A partition taken over came from a snapshot where the killed node's partition had
    // one, not from a full replay.
    let logs: String = (0..2)
        .map(|i| {
            std::fs::read_to_string(dir.path().join(i.to_string()).join("node.log"))
                .unwrap_or_default()
        })
        .collect();
    assert!(
        logs.contains("loaded a snapshot newer than the checkpoint"),
        "no takeover started from a snapshot"
    );
    drop((n0, n1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_query_reaches_the_owner_and_a_forged_partition_is_refused() {
    let nats = TestNats::start_secured().await;
    nats.add_tenant("acme").await;
    let creds = nats.add_agent("acme", "planner", &["task:*"]).await;
    let agent_bus = nats.connect_as(&creds).await.unwrap();
    let agent = Client::from_bus(agent_bus.clone(), RetryPolicy::default());
    let bus = nats.admin.clone();
    let dir = tempfile::tempdir().unwrap();
    let mut written = Written::default();
    written.append(&bus, 0..48).await;
    let _n0 = spawn(&nats, dir.path(), 0);
    let _n1 = spawn(&nats, dir.path(), 1);
    settle(&bus, &["n0", "n1"], Duration::from_secs(60)).await;

    // An agent's query is one request: it publishes once, to its routed subject.
    let before = agent_bus
        .client()
        .statistics()
        .out_messages
        .load(std::sync::atomic::Ordering::Relaxed);
    for i in 0..SCOPES {
        assert_eq!(
            found(&agent, i, written.last).await.as_ref(),
            Ok(&written.ids[&i])
        );
    }
    let sent = agent_bus
        .client()
        .statistics()
        .out_messages
        .load(std::sync::atomic::Ordering::Relaxed)
        - before;
    assert_eq!(sent, SCOPES as u64, "one request per query");

    // A request on another partition's subject than its scope's reaches that partition's
    // owner, which refuses it: no key chooses where its scope is answered.
    let partitions = bus.config().stream.partitions;
    let own = ScopeKey::new(ident("acme"), scope(0)).partition(partitions);
    let other = (own + 1) % partitions;
    let body = serde_json::json!({
        "tenant": "acme", "scope": {"kind": "task", "id": "t-0"}, "grants": [],
        "query": "the deploy",
        "top_k": 5,
    });
    let err = engram_rpc::call::<_, serde_json::Value>(
        agent_bus.client(),
        &format!("engram.n.{other}.acme.planner.retrieve.task.t-0"),
        &body,
        Duration::from_secs(10),
    )
    .await
    .unwrap_err();
    assert_eq!(
        err.code(),
        engram_memory::proto::ErrorCode::Forbidden,
        "{err}"
    );
    // And a body about another scope than its subject's is refused too.
    let err = engram_rpc::call::<_, serde_json::Value>(
        agent_bus.client(),
        "engram.q.acme.planner.retrieve.task.t-1",
        &body,
        Duration::from_secs(10),
    )
    .await
    .unwrap_err();
    assert_eq!(
        err.code(),
        engram_memory::proto::ErrorCode::Invalid,
        "{err}"
    );
}
