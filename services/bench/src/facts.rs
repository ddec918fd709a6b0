//! `engram-bench facts`: what the bi-temporal fact table costs, in process: applying
//! assertions (some out of order), hashing the state, a snapshot's size and round trip, the
//! current, as-of and text queries, and the worst case of one fact re-asserted many times.
//!
//! Run twice over: with few distinct objects (40, repeated) and with mostly distinct ones.

use std::process::ExitCode;
use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use engram_facts::FactTable;
use engram_memory::ScopeKey;
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use serde::Serialize;
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct FactsArgs {
    /// Fact assertions applied per run.
    #[arg(long, default_value_t = 200_000)]
    pub events: u64,
    /// Queries of each kind (current, as-of) per run; text searches are a fiftieth of it.
    #[arg(long, default_value_t = 1_000)]
    pub queries: usize,
    /// Times one fact is re-asserted in the worst-case run.
    #[arg(long, default_value_t = 5_000)]
    pub repeated: u64,
}

#[derive(Debug, Serialize)]
struct Run {
    objects: &'static str,
    events: u64,
    fact_versions: usize,
    apply_secs: f64,
    applied_per_sec: f64,
    state_hash_ms: f64,
    snapshot_bytes: usize,
    snapshot_encode_ms: f64,
    snapshot_decode_ms: f64,
    /// The decoded snapshot hashes like the table it came from.
    snapshot_restores_equal: bool,
    current_us_per_query: f64,
    as_of_us_per_query: f64,
    search_us_per_query: f64,
    facts_found: usize,
}

#[derive(Debug, Serialize)]
struct Repeated {
    times: u64,
    all_ms: f64,
    next_assertion_us: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    runs: Vec<Run>,
    repeated: Repeated,
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn us(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn start() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2024-01-01T00:00:00Z")
        .expect("a valid constant")
        .with_timezone(&Utc)
}

fn scopes() -> anyhow::Result<Vec<ScopeKey>> {
    let tenant = Ident::parse("tenant", "acme")?;
    (0..10)
        .map(|i| {
            Ok(ScopeKey::new(
                tenant.clone(),
                Scope::new(ScopeKind::Team, &format!("team-{i}"))?,
            ))
        })
        .collect()
}

fn assertion(scope: &ScopeKey, data: serde_json::Value, at: DateTime<Utc>) -> Envelope {
    let mut event = Envelope::new(
        scope.tenant.clone(),
        scope.scope(),
        Ident::parse("agent_id", "agent-1").expect("a valid constant"),
        Ident::parse("instance_id", "inst-1").expect("a valid constant"),
        Layer::Semantic,
        EventKind::FactAsserted,
        Content {
            text: String::new(),
            data: Some(data),
        },
    );
    event.occurred_at = at;
    event.recorded_at = at;
    event
}

pub async fn run(args: FactsArgs, json: bool) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.events > 0 && args.queries > 0,
        "--events and --queries must be at least 1"
    );
    let scopes = scopes()?;
    let mut runs = Vec::new();
    for distinct in [false, true] {
        runs.push(measure(&scopes, &args, distinct)?);
    }
    let report = Report {
        runs,
        repeated: repeated(&scopes[0], args.repeated)?,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(ExitCode::SUCCESS)
}

fn measure(scopes: &[ScopeKey], args: &FactsArgs, distinct: bool) -> anyhow::Result<Run> {
    let start = start();
    let n = args.events;
    let subjects = 2_000u64;
    let events: Vec<Envelope> = (0..n)
        .map(|i| {
            // Every tenth event is said an hour earlier than its neighbours: out of order.
            let shift = if i % 10 == 0 { -3600 } else { 0 };
            let at = start + Duration::seconds(i as i64 * 60 + shift);
            let predicate = ["lives_in", "works_at", "likes", "speaks", "owns"][(i % 5) as usize];
            let object = if distinct {
                format!("value {i}")
            } else {
                format!("value {}", (i * 31) % 40)
            };
            let data = json!({
                "subject": format!("user-{}", (i * 7919) % subjects),
                "predicate": predicate,
                "object": object,
                "cardinality": if i % 5 >= 2 { "multi" } else { "single" },
            });
            assertion(&scopes[(i % 10) as usize], data, at)
        })
        .collect();

    let mut table = FactTable::new();
    let t0 = Instant::now();
    for (i, event) in events.iter().enumerate() {
        table.apply(i as u64 + 1, event)?;
    }
    let apply = t0.elapsed();

    let t0 = Instant::now();
    let hash = table.state_hash();
    let state_hash = t0.elapsed();

    let t0 = Instant::now();
    let bytes = rmp_serde::to_vec_named(&table)?;
    let encode = t0.elapsed();
    let t0 = Instant::now();
    let restored: FactTable = rmp_serde::from_slice(&bytes)?;
    let decode = t0.elapsed();

    let queries = args.queries;
    let subject = |i: usize| format!("user-{}", i as u64 % subjects);
    let mut found = 0;
    let t0 = Instant::now();
    for i in 0..queries {
        found += table
            .current(&scopes[i % 10], Some(&subject(i)), None)
            .len();
    }
    let current = t0.elapsed() / queries as u32;
    let t0 = Instant::now();
    for i in 0..queries {
        found += table
            .as_of(
                &scopes[i % 10],
                start + Duration::days(30),
                Some(start + Duration::days(60)),
                Some(&subject(i)),
                None,
            )
            .len();
    }
    let as_of = t0.elapsed() / queries as u32;
    let searches = (queries / 50).max(1);
    let t0 = Instant::now();
    for _ in 0..searches {
        found += table
            .search(&scopes[..1], "where does user-42 live value 7", 10)
            .len();
    }
    let search = t0.elapsed() / searches as u32;

    Ok(Run {
        objects: if distinct { "distinct" } else { "40 repeated" },
        events: n,
        fact_versions: table.len(),
        apply_secs: apply.as_secs_f64(),
        applied_per_sec: n as f64 / apply.as_secs_f64().max(1e-9),
        state_hash_ms: ms(state_hash),
        snapshot_bytes: bytes.len(),
        snapshot_encode_ms: ms(encode),
        snapshot_decode_ms: ms(decode),
        snapshot_restores_equal: restored.state_hash() == hash,
        current_us_per_query: us(current),
        as_of_us_per_query: us(as_of),
        search_us_per_query: us(search),
        facts_found: found,
    })
}

/// The worst case the fact table's docs warn about: one fact re-asserted again and again.
fn repeated(scope: &ScopeKey, times: u64) -> anyhow::Result<Repeated> {
    let start = start();
    let data = || json!({"subject": "alice", "predicate": "likes", "object": "tea"});
    let mut table = FactTable::new();
    let t0 = Instant::now();
    for i in 0..times {
        table.apply(
            i + 1,
            &assertion(scope, data(), start + Duration::seconds(i as i64)),
        )?;
    }
    let all = t0.elapsed();
    let t0 = Instant::now();
    table.apply(times + 1, &assertion(scope, data(), start))?;
    Ok(Repeated {
        times,
        all_ms: ms(all),
        next_assertion_us: us(t0.elapsed()),
    })
}

fn render(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for r in &report.runs {
        let _ = writeln!(out, "-- {} objects", r.objects);
        let _ = writeln!(
            out,
            "apply: {} assertions in {:.2} s ({:.0}/s), {} fact versions",
            r.events, r.apply_secs, r.applied_per_sec, r.fact_versions
        );
        let _ = writeln!(out, "state_hash: {:.2} ms", r.state_hash_ms);
        let _ = writeln!(
            out,
            "snapshot: {:.1} MB, encode {:.2} ms, decode {:.2} ms, equal hash: {}",
            r.snapshot_bytes as f64 / 1e6,
            r.snapshot_encode_ms,
            r.snapshot_decode_ms,
            r.snapshot_restores_equal
        );
        let _ = writeln!(
            out,
            "current(subject): {:.1} us per query; as_of(subject, known_at): {:.1} us; search over one scope: {:.1} us",
            r.current_us_per_query, r.as_of_us_per_query, r.search_us_per_query
        );
    }
    let x = &report.repeated;
    let _ = writeln!(
        out,
        "one fact re-asserted {} times: {:.2} ms in all, the next assertion {:.1} us",
        x.times, x.all_ms, x.next_assertion_us
    );
    out
}
