//! Rough costs of the skill registry: `cargo run --release -p engram-skills --example skills_bench`.
//! Prints figures; asserts nothing.

use std::time::Instant;

use chrono::{DateTime, Utc};
use engram_fixtures::models::{self, t};
use engram_memory::ScopeKey;
use engram_schema::{Envelope, EventKind, Layer};
use engram_skills::SkillRegistry;
use serde_json::json;

const WORDS: &[&str] = &[
    "deploy",
    "service",
    "database",
    "backup",
    "restore",
    "kubernetes",
    "cluster",
    "rotate",
    "credentials",
    "vault",
    "lint",
    "test",
    "build",
    "release",
    "migrate",
    "schema",
    "cache",
    "invalidate",
    "queue",
    "drain",
    "node",
    "upgrade",
    "rollback",
    "monitor",
    "alert",
    "log",
];

fn event(
    scope: &ScopeKey,
    kind: EventKind,
    data: serde_json::Value,
    at: DateTime<Utc>,
) -> Envelope {
    models::event(scope, Layer::Procedural, kind, Some(data), at)
}

fn phrase(seed: usize, len: usize) -> String {
    (0..len)
        .map(|j| WORDS[(seed * 7 + j * 13 + j * j) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() {
    let scopes = models::teams("acme", 10);
    let start = t("2024-01-01");
    let skills = 10_000usize;
    let outcomes = 100_000usize;
    let mut events = Vec::new();
    for i in 0..skills {
        let data = json!({
            "name": format!("skill-{}", i / 2),
            "description": phrase(i, 8),
            "steps": [phrase(i + 1, 5), phrase(i + 2, 5)],
            "preconditions": [phrase(i + 3, 3)],
        });
        events.push(event(
            &scopes[(i / 2) % 10],
            EventKind::SkillRecorded,
            data,
            start,
        ));
    }
    for i in 0..outcomes {
        let data = json!({"skill": format!("skill-{}", (i * 7919) % (skills / 2 + 500)), "success": i % 3 != 0});
        events.push(event(
            &scopes[((i * 7919) % (skills / 2 + 500)) % 10],
            EventKind::Outcome,
            data,
            start,
        ));
    }

    let mut registry = SkillRegistry::new();
    let t0 = Instant::now();
    for (i, event) in events.iter().enumerate() {
        registry.apply(i as u64 + 1, event).unwrap();
    }
    let apply = t0.elapsed();
    println!(
        "apply: {} events in {:.2?} ({:.0}/s), {} skills",
        events.len(),
        apply,
        events.len() as f64 / apply.as_secs_f64(),
        registry.len()
    );

    let t0 = Instant::now();
    let hash = registry.state_hash();
    println!("state_hash: {:.2?}", t0.elapsed());
    let bytes = rmp_serde::to_vec_named(&registry).unwrap();
    let restored: SkillRegistry = rmp_serde::from_slice(&bytes).unwrap();
    println!(
        "snapshot: {} kB, equal hash: {}",
        bytes.len() / 1_000,
        restored.state_hash() == hash
    );

    let t0 = Instant::now();
    let mut found = 0;
    for i in 0..100 {
        found += registry
            .search(&scopes[..1], &format!("how do I {}", phrase(i, 4)), 5)
            .len();
    }
    println!(
        "search over one scope of 500 skills: {:.2?} per query",
        t0.elapsed() / 100
    );
    let t0 = Instant::now();
    for i in 0..20 {
        found += registry
            .search(&scopes, &format!("how do I {}", phrase(i, 4)), 5)
            .len();
    }
    println!(
        "search over ten scopes (5000 skills): {:.2?} per query",
        t0.elapsed() / 20
    );
    std::hint::black_box(found);
}
