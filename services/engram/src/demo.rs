//! The walk-through `engram up --demo` prints, against the services `engram up` started: three
//! instances of one agent append to a shared task (a retry is deduplicated, a stale writer is
//! stopped), then retrieval with its score parts, the context a new step starts with, the
//! fact table after two agents contradict each other (current value and history), a fresh
//! instance replaying the task, working memory expiring, three instances editing the team's
//! task board at once ([`docs`]), one consolidation run ([`consolidation`]), a new instance
//! bootstrapping from a snapshot ([`bootstrap`]), and where to go next ([`next`]). Every
//! query waits for the demo's own writes (`min_seq`), so what it prints does not depend on
//! projector timing, and every claim it prints is checked first: a check that fails ends
//! the demo with an error saying what differed.

mod bootstrap;
mod consolidation;
pub mod continuity;
mod docs;
mod next;

use std::time::Duration;

use crate::up::Running;
use anyhow::Context;
use bytes::Bytes;
use engram_memory::MemoryFilter;
use engram_memory::proto::{
    Consistency, ContextRequest, FactsRequest, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_schema::{EventKind, Ident, Layer, Scope, ScopeKind, SubjectFilter};
use engram_sdk::{AppendError, AppendOptions, Client, RetryPolicy, StartAt};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::output::one_line;

/// What the three instances append: (instance, kind, layer, text, content.data).
fn steps() -> [(&'static str, EventKind, Layer, &'static str, Option<Value>); 6] {
    // Facts and skills carry their typed payload (schemas/README.md): without it the append
    // is refused, since the fact table and skill registry could not apply it.
    let fact = json!({
        "subject": "auth-service",
        "predicate": "builds_sql_by",
        "object": "string concatenation",
    });
    let skill = json!({
        "name": "fix-sql-injection",
        "description": "find string-built SQL, parameterise it, rerun the test suite",
        "steps": ["find string-built SQL", "parameterise it", "rerun the test suite"],
    });
    [
        (
            "i-1",
            EventKind::Observation,
            Layer::Episodic,
            "login returns HTTP 500 when the password contains a quote",
            None,
        ),
        (
            "i-2",
            EventKind::Action,
            Layer::Episodic,
            "ran the auth test suite: 3 failures in test_password_escaping",
            None,
        ),
        (
            "i-1",
            EventKind::FactAsserted,
            Layer::Semantic,
            "the auth service builds its SQL query by string concatenation",
            Some(fact),
        ),
        (
            "i-3",
            EventKind::Action,
            Layer::Episodic,
            "switched the login query to a parameterised statement",
            None,
        ),
        (
            "i-2",
            EventKind::Outcome,
            Layer::Episodic,
            "auth test suite passes: 42 passed, 0 failed",
            None,
        ),
        (
            "i-3",
            EventKind::SkillRecorded,
            Layer::Procedural,
            "to fix injection bugs: find string-built SQL, parameterise it, rerun the suite",
            Some(skill),
        ),
    ]
}

/// Section headings, in the order the demo prints them; the demo test checks each appears.
pub const SECTIONS: [&str; 11] = [
    "== append:",
    "== retrieve:",
    "== build_context:",
    "== facts:",
    "== replay:",
    "== working memory:",
    "== shared documents:",
    "== consolidation:",
    "== snapshot and bootstrap:",
    "== stream ",
    "== next:",
];

/// How long each query waits for the demo's own writes (the first embedding may load the
/// model).
const WAIT_MS: u64 = 30_000;

/// What every section of the demo shares.
struct Demo<'a> {
    running: &'a Running,
    client: Client,
    tenant: Ident,
    task: Scope,
    /// Makes this run's instance ids (and its board and session) its own, so that a second
    /// run on the same home shows the same walk-through.
    run_id: String,
}

impl Demo<'_> {
    /// Instance `instance` of `agent`, as this run names it.
    fn agent(&self, agent: &str, instance: &str) -> anyhow::Result<engram_sdk::Agent> {
        Ok(self
            .client
            .agent("acme", agent, &format!("{instance}-{}", self.run_id))?)
    }

    /// Waits until every projector has applied the whole stream; returns its last seq.
    async fn settled(&self) -> anyhow::Result<u64> {
        let head = self.running.bus.stream_state().await?.last_seq;
        let wait = Duration::from_millis(WAIT_MS);
        match &self.running.node {
            Some(local) => engram_projectors::wait_visible_all(&local.node.instances, head, wait)
                .await
                .map_err(|f| anyhow::anyhow!("{f}"))?,
            // Node processes: every model's ledger, once each partition is visible there.
            None => {
                let consistency = engram_memory::proto::Consistency {
                    min_seq: Some(head),
                    wait_ms: Some(WAIT_MS),
                };
                let partitions = self.running.bus.config().stream.partitions;
                for model in engram_projectors::ProjectorName::all() {
                    engram_projectors::ledger_of(
                        self.running.bus.client(),
                        model.as_str(),
                        partitions,
                        &consistency,
                        wait + Duration::from_secs(5),
                    )
                    .await
                    .map_err(|f| anyhow::anyhow!("{model}: {f}"))?;
                }
            }
        }
        Ok(head)
    }

    /// The newest dead letter's sequence in the dead-letter stream (0: none).
    async fn newest_dead_letter(&self) -> anyhow::Result<u64> {
        let letters = self.dead_letters().await?;
        Ok(letters.iter().map(|d| d.dlq_seq).max().unwrap_or(0))
    }

    async fn dead_letters(&self) -> anyhow::Result<Vec<engram_memory::proto::DeadLetterInfo>> {
        Ok(self
            .client
            .list_dead_letters(&engram_memory::proto::DeadLettersRequest {
                tenant: self.tenant.clone(),
                limit: engram_memory::proto::limits::MAX_DEAD_LETTERS,
            })
            .await?
            .dead_letters)
    }

    /// Fails when a projector dead-lettered anything since `since` (once every projector has
    /// applied the whole stream); returns the stream's last seq.
    async fn no_dead_letter_since(&self, since: u64) -> anyhow::Result<u64> {
        let head = self.settled().await?;
        let new: Vec<String> = self
            .dead_letters()
            .await?
            .into_iter()
            .filter(|d| d.dlq_seq > since)
            .map(|d| {
                format!(
                    "{} refused seq {:?} ({}): {}",
                    d.projector,
                    d.event_seq,
                    d.kind.unwrap_or_default(),
                    d.reason
                )
            })
            .collect();
        anyhow::ensure!(
            new.is_empty(),
            "a projector dead-lettered a demo event: {}",
            new.join("; ")
        );
        Ok(head)
    }
}

/// Read-your-writes at `seq`, waiting up to [`WAIT_MS`].
fn after(seq: u64) -> Consistency {
    Consistency {
        min_seq: Some(seq),
        wait_ms: Some(WAIT_MS),
    }
}

/// The first 8 bytes of a digest, hex.
fn short_hex(hash: &[u8]) -> String {
    hash.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

pub async fn run(running: &Running) -> anyhow::Result<()> {
    let bus = &running.bus;
    let client = Client::from_bus(bus.clone(), RetryPolicy::default());
    let tenant = Ident::parse("tenant", "acme")?;
    let task = Scope::new(ScopeKind::Task, "fix-login-bug")?;
    let run_id = chrono::Utc::now().format("%H%M%S").to_string();
    let demo = Demo {
        running,
        client: client.clone(),
        tenant: tenant.clone(),
        task: task.clone(),
        run_id: run_id.clone(),
    };
    // Dead letters from before this run are not this run's.
    let dead_letters_before = demo.newest_dead_letter().await?;
    // Every query reads the task scope, after the demo's latest write: read-your-writes.
    let scopes = ScopeRequest {
        tenant: tenant.clone(),
        scope: task.clone(),
        grants: Vec::new(),
    };

    println!(
        "\n{} three instances of agent \"coder\" share task:fix-login-bug (tenant acme) ==",
        SECTIONS[0]
    );
    let mut first = None;
    let mut last_seq = 0;
    for (instance, kind, layer, text, data) in steps() {
        let agent = client.agent("acme", "coder", &format!("{instance}-{run_id}"))?;
        let mut builder = agent
            .event(task.clone(), layer, kind, text)
            .tag("demo")
            .importance(if kind == EventKind::SkillRecorded {
                0.9
            } else {
                0.6
            });
        if let Some(data) = data {
            builder = builder.data(data);
        }
        let event = builder.build()?;
        let receipt = client.append(&event).await?;
        println!(
            "  {instance}  {:<15} seq={:<5} {}",
            kind.as_str(),
            receipt.seq,
            one_line(text, 70)
        );
        last_seq = receipt.seq;
        first.get_or_insert((event, receipt));
    }
    let (first_event, first_receipt) = first.context("no demo event")?;
    let retry = client.append(&first_event).await?;
    anyhow::ensure!(
        retry.duplicate && retry.seq == first_receipt.seq,
        "a retry of seq {} was stored again: {retry:?}",
        first_receipt.seq
    );
    println!(
        "  a retry of seq={} after a lost ack reuses its event id: duplicate={} seq={} (stored once)",
        first_receipt.seq, retry.duplicate, retry.seq
    );
    let agent = client.agent("acme", "coder", &format!("i-9-{run_id}"))?;
    let stale = agent
        .event(
            task.clone(),
            Layer::Episodic,
            EventKind::Observation,
            "stale view",
        )
        .build()?;
    match client
        .append_with(
            &stale,
            AppendOptions {
                expected_last_subject_seq: Some(first_receipt.seq),
                ..AppendOptions::default()
            },
        )
        .await
    {
        Err(AppendError::Conflict { subject, expected }) => println!(
            "  a writer that read an old position (seq {expected}) is refused: conflict on {subject}, nothing written"
        ),
        other => anyhow::bail!("a stale writer was not refused: {other:?}"),
    }

    let query = "why does login fail when the password has a quote";
    println!("\n{} {query:?} (hybrid: dense + BM25) ==", SECTIONS[1]);
    let found = client
        .retrieve(&RetrieveRequest {
            scopes: scopes.clone(),
            query: query.into(),
            vector: None,
            top_k: 3,
            filter: MemoryFilter::default(),
            consistency: after(last_seq),
            mode: RetrievalMode::Hybrid,
            ranking: None,
        })
        .await?;
    for (i, r) in found.results.iter().enumerate() {
        let p = &r.parts;
        println!("  {}. [{:.3}] {}", i + 1, r.score, one_line(&r.text, 70));
        println!(
            "     dense {}  bm25 {}  fusion {:.4}  recency +{:.4}  importance +{:.4}  (seq {}, {})",
            p.dense.map_or("-".into(), |d| format!("{d:.3}")),
            p.keyword.map_or("-".into(), |k| format!("{k:.2}")),
            p.fused,
            p.recency_boost,
            p.importance_boost,
            r.seq,
            r.agent_id,
        );
    }

    println!(
        "\n{} what a new step of agent \"coder\" starts with ==",
        SECTIONS[2]
    );
    let context = client
        .build_context(&ContextRequest {
            scopes: scopes.clone(),
            agent_id: Ident::parse("agent", "coder")?,
            task: task.id.to_string(),
            query: "how do I fix the login bug".into(),
            vector: None,
            token_budget: 256,
            consistency: after(last_seq),
        })
        .await?;
    for line in context.rendered.lines() {
        println!("  | {line}");
    }
    println!(
        "  {} items, {} tokens of a {}-token budget ({} left out)",
        context.items.len(),
        context.tokens,
        context.token_budget,
        context.dropped
    );

    let reviewer = client.agent("acme", "reviewer", &format!("r-1-{run_id}"))?;
    let contradiction = reviewer
        .event(
            task.clone(),
            Layer::Semantic,
            EventKind::FactAsserted,
            "the auth service now builds its SQL with parameterised statements",
        )
        .tag("demo")
        .data(json!({
            "subject": "auth-service",
            "predicate": "builds_sql_by",
            "object": "parameterised statements",
        }))
        .append()
        .await?;
    println!(
        "\n{} agent \"reviewer\" contradicts \"coder\" (seq={}): auth-service builds_sql_by \"parameterised statements\" ==",
        SECTIONS[3], contradiction.seq
    );
    let fact = |history: bool| FactsRequest {
        scopes: scopes.clone(),
        subject: Some("auth-service".into()),
        predicate: Some("builds_sql_by".into()),
        text: None,
        valid_at: None,
        known_at: None,
        history,
        limit: 20,
        consistency: after(contradiction.seq),
    };
    let now = chrono::Utc::now();
    let current = client.facts(&fact(false)).await?;
    println!("  current (single-valued: the later assertion wins)");
    for line in crate::commands::facts::table(&current.facts, now).lines() {
        println!("    {line}");
    }
    let history = client.facts(&fact(true)).await?;
    println!("  history (nothing is lost: the old value is superseded, not deleted)");
    for line in crate::commands::facts::table(&history.facts, now).lines() {
        println!("    {line}");
    }

    println!(
        "\n{} a fresh instance rebuilds its memory of the task ==",
        SECTIONS[4]
    );
    let filter = SubjectFilter::all()
        .tenant(tenant.clone())
        .scope(task.kind, task.id.clone());
    let mut replay = client
        .replay(&filter, StartAt::Seq(first_receipt.seq))
        .await?;
    let mut n = 0;
    while let Some(item) = replay.next().await {
        let stored = item?;
        n += 1;
        println!(
            "  seq {:<5} {:<11} {:<15} {:<9} {}",
            stored.seq,
            stored.event.layer.as_str(),
            stored.event.kind.as_str(),
            stored.event.agent_id.as_str(),
            one_line(&stored.event.content.text, 55)
        );
    }
    println!("  replayed {n} events");

    println!("\n{} per-scope keys with a TTL ==", SECTIONS[5]);
    let wm = client.working_memory().await?;
    wm.put(
        &tenant,
        &task,
        "current-step",
        Bytes::from("verify fix in staging"),
        Some(Duration::from_secs(2)),
    )
    .await?;
    let now = wm.get(&tenant, &task, "current-step").await?;
    println!(
        "  put current-step (ttl 2s) -> get: {:?}",
        now.as_deref().map(String::from_utf8_lossy)
    );
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let later = wm.get(&tenant, &task, "current-step").await?;
    anyhow::ensure!(
        now.as_deref() == Some(b"verify fix in staging".as_slice()) && later.is_none(),
        "working memory did not expire: {now:?} then {later:?}"
    );
    println!(
        "  3s later -> get: {:?} (expired)",
        later.as_deref().map(String::from_utf8_lossy)
    );

    docs::run(&demo).await?;
    consolidation::run(&demo).await?;
    bootstrap::run(&demo).await?;

    let head = demo.no_dead_letter_since(dead_letters_before).await?;
    let summary = bus.stream_summary().await?;
    println!(
        "\n{}{}: {} events, last seq {}; every projector applied all of it, no dead letter ==",
        SECTIONS[9], summary.name, summary.messages, head
    );
    next::run(&demo).await
}

#[cfg(test)]
mod tests {
    use engram_schema::{Content, Envelope, Payload};

    use super::*;

    /// A new user's first run must show no refusal and no dead letter: every demo event
    /// passes the contract, and the fact and the skill carry the payload their read model
    /// applies.
    #[test]
    fn every_demo_event_keeps_the_contract() {
        let id = |s: &str| Ident::parse("id", s).unwrap();
        let task = Scope::new(ScopeKind::Task, "fix-login-bug").unwrap();
        for (instance, kind, layer, text, data) in steps() {
            let event = Envelope::new(
                id("acme"),
                task.clone(),
                id("coder"),
                id(instance),
                layer,
                kind,
                Content {
                    text: text.into(),
                    data,
                },
            );
            event.validate().unwrap();
            if matches!(kind, EventKind::FactAsserted | EventKind::SkillRecorded) {
                assert!(Payload::of(&event).unwrap().is_some(), "{kind}");
            }
        }
    }
}
