//! `engram-bench docs`: what shared documents cost, in process: a team of writers editing
//! one task board through their own copies, every change merged by the document store in
//! stream order, as the projector does. Reports merge throughput, the document's size
//! compacted and as the changes that built it, and the cost per change.
//!
//! The default is the team: 300 instances working for an hour, each pushing an
//! edit a minute (18,000 events), a fifth of them offline for the first half hour and
//! pushing their edits late.

use std::process::ExitCode;
use std::time::Instant;

use engram_docs::{DocId, DocStore, DocType, LocalDoc, TaskBoard, TaskItem, TaskStatus};
use engram_memory::ScopeKey;
use engram_memory::model::EventModel;
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

#[derive(Debug, clap::Args)]
pub struct DocsArgs {
    /// Instances editing the board.
    #[arg(long, default_value_t = 300)]
    pub writers: usize,
    /// Edits each instance pushes (one a minute for an hour by default).
    #[arg(long, default_value_t = 60)]
    pub edits: usize,
    /// Items on the board; each edit changes one of them.
    #[arg(long, default_value_t = 200)]
    pub items: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    writers: usize,
    edits_per_writer: usize,
    events: u64,
    changes: u64,
    /// Writers' time to make their edits and encode the pushes (hydrate, edit, reconcile).
    edit_s: f64,
    /// The store's time to merge every event in stream order.
    merge_s: f64,
    merged_events_per_s: f64,
    merge_us_per_change: f64,
    /// The board compacted (`save`), as a snapshot and a new writer's fork hold it.
    compacted_bytes: usize,
    /// The changes as sent (base64 in events), before compaction.
    sent_change_bytes: u64,
    conflicts: usize,
    held: usize,
    /// Every writer's last item is on the merged board.
    complete: bool,
}

pub async fn run(args: DocsArgs, json: bool) -> anyhow::Result<ExitCode> {
    if args.writers == 0 || args.edits == 0 || args.items == 0 {
        anyhow::bail!("--writers, --edits and --items must be at least 1");
    }
    let report = tokio::task::spawn_blocking(move || bench(&args)).await??;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{} writers x {} edits: {} events, {} changes; merged in {:.2}s ({:.0} events/s, {:.1} us/change); board {} bytes compacted vs {} bytes of changes sent; {} conflicting fields; complete {}",
            report.writers,
            report.edits_per_writer,
            report.events,
            report.changes,
            report.merge_s,
            report.merged_events_per_s,
            report.merge_us_per_change,
            report.compacted_bytes,
            report.sent_change_bytes,
            report.conflicts,
            report.complete
        );
    }
    anyhow::ensure!(
        report.complete && report.held == 0,
        "the merged board lost an edit"
    );
    Ok(ExitCode::SUCCESS)
}

fn bench(args: &DocsArgs) -> anyhow::Result<Report> {
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let scope = ScopeKey::new(
        Ident::parse("tenant", "bench")?,
        Scope::new(ScopeKind::Team, "core")?,
    );
    let mut writers: Vec<LocalDoc> = (0..args.writers)
        .map(|_| LocalDoc::genesis::<TaskBoard>())
        .collect::<Result<_, _>>()?;
    // Rounds: in each, every online writer makes one edit and pushes it. The offline fifth
    // keeps its edits for the first half, then pushes them all at once.
    let mut events = Vec::new();
    let mut sent_change_bytes = 0u64;
    let started = Instant::now();
    for round in 0..args.edits {
        for (w, writer) in writers.iter_mut().enumerate() {
            let item = format!("t-{}", rng.random_range(0..args.items));
            writer.edit(|b: &mut TaskBoard| {
                let it = b.items.entry(item).or_insert_with(|| TaskItem {
                    title: "work".into(),
                    ..TaskItem::default()
                });
                it.owner = Some(format!("i-{w}"));
                it.status = [TaskStatus::Todo, TaskStatus::Doing, TaskStatus::Done][round % 3];
                it.notes.push(format!("i-{w} round {round}"));
                b.items.insert(
                    format!("last-{w}"),
                    TaskItem {
                        title: format!("round {round}"),
                        ..TaskItem::default()
                    },
                );
            })?;
            let offline = w % 5 == 0 && round < args.edits / 2;
            if offline {
                continue;
            }
            for out in writer.outgoing(TaskBoard::TYPE, "sprint", 150_000)? {
                writer.mark_sent(&out.synced_after);
                sent_change_bytes += out.data["changes"].as_array().map_or(0, |c| {
                    c.iter()
                        .map(|s| s.as_str().map_or(0, str::len) as u64)
                        .sum()
                });
                let mut e = Envelope::new(
                    scope.tenant.clone(),
                    scope.scope(),
                    Ident::parse("agent", "bench")?,
                    Ident::parse("instance", format!("i-{w}"))?,
                    Layer::Working,
                    EventKind::DocChanged,
                    Content {
                        text: String::new(),
                        data: Some(out.data),
                    },
                );
                e.importance = 0.5;
                events.push(e);
            }
        }
    }
    let edit_s = started.elapsed().as_secs_f64();
    let mut store = DocStore::default();
    let started = Instant::now();
    for (i, e) in events.iter().enumerate() {
        store.apply(i as u64 + 1, e)?;
    }
    let merge_s = started.elapsed().as_secs_f64();
    let id = DocId {
        doc_type: Ident::parse("doc_type", TaskBoard::TYPE)?,
        name: Ident::parse("name", "sprint")?,
    };
    let entry = store
        .get(&scope, &id)
        .ok_or_else(|| anyhow::anyhow!("no board"))?;
    let board: TaskBoard = entry.hydrate()?;
    let complete = (0..args.writers).all(|w| {
        board
            .items
            .get(&format!("last-{w}"))
            .is_some_and(|it| it.title == format!("round {}", args.edits - 1))
    });
    let changes = entry.changes();
    let _ = store.state_hash();
    Ok(Report {
        writers: args.writers,
        edits_per_writer: args.edits,
        events: events.len() as u64,
        changes,
        edit_s,
        merge_s,
        merged_events_per_s: events.len() as f64 / merge_s,
        merge_us_per_change: merge_s * 1e6 / changes as f64,
        compacted_bytes: entry.saved().len(),
        sent_change_bytes,
        conflicts: entry.view().conflicts.len(),
        held: entry.held(),
        complete,
    })
}
