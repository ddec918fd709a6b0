//! A snapshot is cut; two more events come in; a new instance bootstraps its scopes from the
//! snapshot and the tail after it, and its state equals a replay of their whole history.

use std::collections::BTreeMap;

use anyhow::Context as _;
use engram_docs::DocId;
use engram_memory::ScopeKey;
use engram_memory::proto::{ScopeRequest, read_models};
use engram_schema::{EventKind, Ident, Layer, SubjectFilter};
use engram_sdk::StartAt;
use engram_snapshots::SnapshotMeta;
use futures::StreamExt;
use serde_json::json;

use super::{Demo, SECTIONS, short_hex};

pub(super) async fn run(demo: &Demo<'_>) -> anyhow::Result<()> {
    let (team, board) = super::docs::board(demo)?;
    let scopes = ScopeRequest {
        tenant: demo.tenant.clone(),
        scope: demo.task.clone(),
        grants: vec![team.clone()],
    };
    println!(
        "\n{} a new instance of {} (reading {team}) starts from a snapshot, not from seq 1 ==",
        SECTIONS[8], demo.task
    );
    // Everything so far is applied, so the snapshots hold all of it.
    let before = demo.settled().await?;
    let cut = demo.client.snapshot(&scopes, None).await?;
    let mut cuts = BTreeMap::new();
    for meta in &cut.snapshots {
        let meta: SnapshotMeta =
            serde_json::from_value(meta.clone()).context("a snapshot's index entry")?;
        cuts.insert(meta.projector.clone(), meta);
    }
    // Each partition of the stream has its own instance of every model, and its own
    // snapshot of it; the scopes' partitions are the ones a bootstrap loads.
    let partitions = demo.running.bus.config().stream.partitions;
    let held: Vec<u32> = {
        let mut held: Vec<u32> = [&scopes.scope, &team]
            .iter()
            .map(|s| ScopeKey::new(demo.tenant.clone(), (*s).clone()).partition(partitions))
            .collect();
        held.dedup();
        held
    };
    // The models a bootstrap loads from snapshots. A set of partitions' snapshots goes by
    // its newest: asked for as a version, each partition gives its newest at or below it.
    let models: Vec<&str> = read_models::with_scope_snapshots().collect();
    let mut versions = BTreeMap::new();
    let mut cut_line = Vec::new();
    // Where each partition's snapshots stop: its scopes' tails start there.
    let mut partition_cut = BTreeMap::new();
    for &model in &models {
        let mut newest: Option<&SnapshotMeta> = None;
        for &p in &held {
            let instance = engram_memory::proto::instance_name(model, p);
            let meta = cuts
                .get(&instance)
                .with_context(|| format!("no {instance} snapshot was cut: {:?}", cut.skipped))?;
            // Cut once everything was applied: it holds its partition's events through the
            // stream's end.
            anyhow::ensure!(
                meta.version > 0 && meta.version <= before,
                "the {instance} snapshot holds seq {}, the stream was at {before}",
                meta.version
            );
            if newest.is_none_or(|o| meta.version > o.version) {
                newest = Some(meta);
            }
            partition_cut.insert(p, meta.version);
        }
        let newest = newest.context("the scopes are in no partition")?;
        cut_line.push(format!("{model} v{}", newest.version));
        versions.insert(model.to_owned(), newest.clone());
    }
    println!(
        "  snapshot cut of every read model in each of the {partitions} partitions: {} for these scopes (+{} more; state hashes in `engram snapshot list`)",
        cut_line.join(", "),
        cuts.len() - models.len() * held.len()
    );

    // Two more events, after the snapshot.
    let done = engram_sdk::Agent::edit_doc(
        &demo.agent("coder", "i-2")?,
        team.clone(),
        "task_board",
        &board,
        None,
        &[("/items/t-1/status".into(), json!("done"))],
        &[],
    )
    .await?;
    let fixed = demo
        .agent("reviewer", "r-1")?
        .event(
            demo.task.clone(),
            Layer::Semantic,
            EventKind::FactAsserted,
            "the login bug is fixed",
        )
        .tag("demo")
        .data(json!({"subject": "login-bug", "predicate": "status", "object": "fixed"}))
        .append()
        .await?;
    println!(
        "  then: i-2 marks t-1 done (seq={}), reviewer asserts login-bug status \"fixed\" (seq={})",
        done.receipt.seq, fixed.seq
    );

    // The new instance, and a replay of the same scopes' whole history at the same seq (an
    // event appended between the two, a usage report say, makes them read to different
    // seqs: then both are read again).
    let (booted, full) = {
        let mut attempt = 0;
        loop {
            let booted = demo.client.bootstrap_with(&scopes, None, 0).await?;
            let full = demo.client.bootstrap_with(&scopes, None, u64::MAX).await?;
            attempt += 1;
            if booted.memory.through == full.memory.through || attempt == 3 {
                break (booted, full);
            }
        }
    };
    anyhow::ensure!(
        booted.memory.through == full.memory.through,
        "the stream kept growing: the bootstrap read to seq {}, the replay to {}",
        booted.memory.through,
        full.memory.through
    );
    anyhow::ensure!(
        full.snapshots.iter().all(|(_, s)| s.is_none()),
        "the full replay loaded a snapshot: {:?}",
        full.snapshots
    );
    let mut used = Vec::new();
    for (model, snapshot) in &booted.snapshots {
        let snapshot = snapshot
            .as_ref()
            .with_context(|| format!("the bootstrap loaded no {model} snapshot"))?;
        let ours = versions.get(model.as_str()).map(|m| m.version);
        anyhow::ensure!(
            ours == Some(snapshot.version),
            "the bootstrap loaded {model} v{}, not the snapshot just cut ({ours:?})",
            snapshot.version
        );
        used.push(format!("{model} v{}", snapshot.version));
    }
    // The tail is exactly each scope's events after its partition's snapshot.
    let mut tail = 0;
    for key in scopes.resolve().map_err(anyhow::Error::msg)? {
        let from = partition_cut[&key.partition(partitions)];
        tail += events_between(demo, &key, from, booted.memory.through).await?;
    }
    anyhow::ensure!(
        booted.replayed == tail && tail >= 2,
        "the bootstrap replayed {} tail events; the scopes hold {tail} after their snapshots",
        booted.replayed
    );
    // It holds what came after the snapshot: t-1 done, the new fact.
    let key = ScopeKey::new(demo.tenant.clone(), team.clone());
    let id = DocId {
        doc_type: Ident::parse("doc_type", "task_board")?,
        name: Ident::parse("name", board.as_str())?,
    };
    let status = booted
        .memory
        .docs
        .get(&key, &id)
        .map(|d| d.view().value["items"]["t-1"]["status"].clone());
    anyhow::ensure!(
        status == Some(json!("done")),
        "the bootstrapped board shows t-1 {status:?}, not done"
    );
    let (b, f) = (booted.memory.state_hash(), full.memory.state_hash());
    anyhow::ensure!(
        b == f,
        "the bootstrapped state {} differs from a full replay's {}",
        short_hex(&b),
        short_hex(&f)
    );
    println!(
        "  bootstrap: {} from the snapshot, then replayed {} tail events (of {} in these scopes)",
        used.join(", "),
        booted.replayed,
        full.replayed
    );
    println!(
        "  state hash at seq {}: bootstrap {} = full replay {} (equal); its board shows t-1 done",
        booted.memory.through,
        short_hex(&b),
        short_hex(&f)
    );
    Ok(())
}

/// Events of the scope with a seq in `(from, through]`, counted by replaying it.
async fn events_between(
    demo: &Demo<'_>,
    key: &ScopeKey,
    from: u64,
    through: u64,
) -> anyhow::Result<u64> {
    let mut n = 0;
    let filter = SubjectFilter::all()
        .tenant(key.tenant.clone())
        .scope(key.kind, key.id.clone());
    let mut replay = demo.client.replay(&filter, StartAt::Seq(from + 1)).await?;
    while let Some(item) = replay.next().await {
        if item?.seq <= through {
            n += 1;
        }
    }
    Ok(n)
}
