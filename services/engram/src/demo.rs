//! The walk-through `engram up --demo` prints: three instances of one agent share a task,
//! a retry is deduplicated, a stale writer is stopped, a fresh instance rebuilds its memory by
//! replay, and working memory expires.

use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use engram_bus::Bus;
use engram_schema::{EventKind, Layer, Scope, ScopeKind, SubjectFilter};
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

pub async fn run(bus: &Bus) -> anyhow::Result<()> {
    let client = Client::from_bus(bus.clone(), RetryPolicy::default());
    let task = Scope::new(ScopeKind::Task, "fix-login-bug")?;
    let run_id = chrono::Utc::now().format("%H%M%S").to_string();
    println!(
        "\n== demo: three instances of agent \"coder\" share task:fix-login-bug (tenant acme) =="
    );

    let mut first = None;
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
        first.get_or_insert((event, receipt));
    }
    let (first_event, first_receipt) = first.context("no demo event")?;

    println!("\n== a retry after a lost ack reuses the event id, so it is stored once ==");
    let retry = client.append(&first_event).await?;
    println!(
        "  retry of seq={}: duplicate={} seq={}",
        first_receipt.seq, retry.duplicate, retry.seq
    );

    println!("\n== optimistic concurrency: a writer that read an old position is refused ==");
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
        Err(AppendError::Conflict { subject, expected }) => {
            println!("  conflict on {subject} (expected last seq {expected}): nothing written");
        }
        other => println!("  unexpected: {other:?}"),
    }

    println!("\n== a fresh instance rebuilds its memory by replaying the task scope ==");
    let filter = SubjectFilter::all()
        .tenant(engram_schema::Ident::parse("tenant", "acme")?)
        .scope(task.kind, task.id.clone());
    let mut replay = client
        .replay(&filter, StartAt::Seq(first_receipt.seq))
        .await?;
    let mut n = 0;
    while let Some(item) = replay.next().await {
        let stored = item?;
        n += 1;
        println!(
            "  seq {:<5} {:<11} {:<15} {}",
            stored.seq,
            stored.event.layer.as_str(),
            stored.event.kind.as_str(),
            one_line(&stored.event.content.text, 60)
        );
    }
    println!("  replayed {n} events");

    println!("\n== working memory: per-scope keys with a TTL ==");
    let wm = client.working_memory().await?;
    let tenant = engram_schema::Ident::parse("tenant", "acme")?;
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
    println!(
        "  3s later -> get: {:?} (expired)",
        later.as_deref().map(String::from_utf8_lossy)
    );

    let summary = bus.stream_summary().await?;
    println!(
        "\n== stream {}: {} events, last seq {} ==",
        summary.name, summary.messages, summary.last_seq
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use engram_schema::{Content, Envelope, Ident, Payload};

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
