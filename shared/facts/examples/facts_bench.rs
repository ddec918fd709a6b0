//! Rough costs of the fact table: `cargo run --release -p engram-facts --example facts_bench`.
//! Prints figures; asserts nothing.

use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use engram_facts::FactTable;
use engram_memory::ScopeKey;
use engram_memory::testing::{self, t};
use engram_schema::{Envelope, EventKind, Layer};
use serde_json::json;

fn event(scope: &ScopeKey, data: serde_json::Value, at: DateTime<Utc>) -> Envelope {
    testing::event(
        scope,
        Layer::Semantic,
        EventKind::FactAsserted,
        Some(data),
        at,
    )
}

fn main() {
    // Few distinct facts repeated many times, then mostly distinct ones.
    for distinct in [false, true] {
        println!(
            "-- {} objects",
            if distinct { "distinct" } else { "40 repeated" }
        );
        run(distinct);
    }
}

fn run(distinct: bool) {
    let scopes = testing::teams("acme", 10);
    let start = t("2024-01-01");
    let n: u64 = 200_000;
    let events: Vec<Envelope> = (0..n)
        .map(|i| {
            // Every tenth event is said an hour earlier than its neighbours: out of order.
            let shift = if i % 10 == 0 { -3600 } else { 0 };
            let at = start + Duration::seconds(i as i64 * 60 + shift);
            let predicate = ["lives_in", "works_at", "likes", "speaks", "owns"][(i % 5) as usize];
            let data = json!({
                "subject": format!("user-{}", (i * 7919) % 2_000),
                "predicate": predicate,
                "object": if distinct { format!("value {i}") } else { format!("value {}", (i * 31) % 40) },
                "cardinality": if i % 5 >= 2 { "multi" } else { "single" },
            });
            event(&scopes[(i % 10) as usize], data, at)
        })
        .collect();

    let mut table = FactTable::new();
    let t0 = Instant::now();
    for (i, event) in events.iter().enumerate() {
        table.apply(i as u64 + 1, event).unwrap();
    }
    let apply = t0.elapsed();
    println!(
        "apply: {n} assertions in {:.2?} ({:.0}/s), {} fact versions",
        apply,
        n as f64 / apply.as_secs_f64(),
        table.len()
    );

    let t0 = Instant::now();
    let hash = table.state_hash();
    println!(
        "state_hash: {:.2?} ({:02x}{:02x}..)",
        t0.elapsed(),
        hash[0],
        hash[1]
    );

    let t0 = Instant::now();
    let bytes = rmp_serde::to_vec_named(&table).unwrap();
    let encode = t0.elapsed();
    let t0 = Instant::now();
    let restored: FactTable = rmp_serde::from_slice(&bytes).unwrap();
    println!(
        "snapshot: {} MB, encode {:.2?}, decode {:.2?}, equal hash: {}",
        bytes.len() / 1_000_000,
        encode,
        t0.elapsed(),
        restored.state_hash() == hash
    );

    let t0 = Instant::now();
    let mut found = 0;
    for i in 0..1_000 {
        found += table
            .current(&scopes[i % 10], Some(&format!("user-{}", i % 2_000)), None)
            .len();
    }
    println!(
        "current(subject): {:.2?} per query ({found} facts in 1000 queries)",
        t0.elapsed() / 1_000
    );

    let t0 = Instant::now();
    for i in 0..1_000 {
        found += table
            .as_of(
                &scopes[i % 10],
                start + Duration::days(30),
                Some(start + Duration::days(60)),
                Some(&format!("user-{}", i % 2_000)),
                None,
            )
            .len();
    }
    println!(
        "as_of(subject, known_at): {:.2?} per query",
        t0.elapsed() / 1_000
    );

    let t0 = Instant::now();
    for _ in 0..20 {
        found += table
            .search(&scopes[..1], "where does user-42 live value 7", 10)
            .len();
    }
    println!("search over one scope: {:.2?} per query", t0.elapsed() / 20);

    // The worst case the docs warn about: one fact re-asserted again and again.
    let mut table = FactTable::new();
    let repeated = 5_000;
    let t0 = Instant::now();
    for i in 0..repeated {
        let data = json!({"subject": "alice", "predicate": "likes", "object": "tea"});
        table
            .apply(
                i + 1,
                &event(&scopes[0], data, start + Duration::seconds(i as i64)),
            )
            .unwrap();
    }
    let all = t0.elapsed();
    let t0 = Instant::now();
    let data = json!({"subject": "alice", "predicate": "likes", "object": "tea"});
    table
        .apply(repeated + 1, &event(&scopes[0], data, start))
        .unwrap();
    println!(
        "one fact re-asserted {repeated} times: {:.2?} in all, the next assertion {:.2?}",
        all,
        t0.elapsed()
    );
    std::hint::black_box(found);
}
