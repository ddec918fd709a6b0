//! Near-duplicate observations and a finished session go in; one consolidation run merges the
//! duplicates (naming its sources and counting recurrences), summarises the session, and
//! supersedes the originals without deleting them; `consolidate --restore` brings one back.

use std::collections::BTreeSet;

use anyhow::Context as _;
use engram_memory::MemoryFilter;
use engram_memory::proto::{RetrievalMode, RetrieveRequest, RetrieveResponse, ScopeRequest};
use engram_schema::{Envelope, EventKind, Layer, Scope, ScopeKind, SubjectFilter};
use engram_sdk::StartAt;
use futures::StreamExt;
use serde_json::{Value, json};

use super::{Demo, SECTIONS, after};
use crate::commands::consolidate;
use crate::output::one_line;

/// One lesson, as three instances report it in their own words.
const LESSON: &str = "the login test fails when the password holds a single quote";

pub(super) async fn run(demo: &Demo<'_>) -> anyhow::Result<()> {
    let session = Scope::new(ScopeKind::Session, &format!("fix-login-{}", demo.run_id))?;
    let scopes = ScopeRequest {
        tenant: demo.tenant.clone(),
        scope: session.clone(),
        grants: Vec::new(),
    };
    println!(
        "\n{} three instances report one lesson in {session}, then the session ends ==",
        SECTIONS[7]
    );
    let again = format!("{LESSON} again");
    let seen = format!("seen again: {LESSON}");
    let inputs: [(&str, EventKind, &str); 5] = [
        ("i-1", EventKind::Observation, LESSON),
        ("i-2", EventKind::Observation, &again),
        ("i-3", EventKind::Observation, &seen),
        (
            "i-2",
            EventKind::Action,
            "escaped the password with a bound parameter in the login query",
        ),
        (
            "i-3",
            EventKind::Outcome,
            "the login tests pass with quoted passwords",
        ),
    ];
    let mut written: Vec<(String, u64, Envelope)> = Vec::new();
    for (instance, kind, text) in inputs {
        let event = demo
            .agent("coder", instance)?
            .event(session.clone(), Layer::Episodic, kind, text)
            .tag("demo")
            .importance(0.6)
            .build()?;
        let receipt = demo.client.append(&event).await?;
        println!(
            "  {instance}  {:<15} seq={:<5} {}",
            kind.as_str(),
            receipt.seq,
            one_line(text, 70)
        );
        written.push((instance.to_owned(), receipt.seq, event));
    }
    let duplicates = &written[..3];
    let end = demo
        .agent("coder", "i-1")?
        .event(
            session.clone(),
            Layer::Working,
            EventKind::Checkpoint,
            "session over: login fixed",
        )
        .data(json!({"finished": true}))
        .append()
        .await?;
    println!(
        "  i-1  {:<15} seq={:<5} session over: login fixed {{\"finished\": true}}",
        "checkpoint", end.seq
    );

    // One run, as `engram consolidate --tenant acme --scope session:...` makes it.
    let request = consolidate::request(scopes.clone(), Vec::new(), &[], after(end.seq))?;
    let (events, receipts) = demo.client.consolidate(&request).await?;
    let mut seqs = Vec::new();
    for (event, receipt) in events.iter().zip(&receipts) {
        match receipt {
            Ok(r) => seqs.push(r.seq),
            Err(e) => anyhow::bail!("consolidation output {} not appended: {e}", event.event_id),
        }
    }
    anyhow::ensure!(
        receipts.len() == events.len(),
        "{} consolidation outputs, {} receipts",
        events.len(),
        receipts.len()
    );
    let op = |e: &Envelope| data_of(e)["op"].as_str().map(str::to_owned);
    let one = |wanted: &dyn Fn(&Envelope) -> bool, what: &str| -> anyhow::Result<usize> {
        let found: Vec<usize> = (0..events.len()).filter(|&i| wanted(&events[i])).collect();
        match found.as_slice() {
            [i] => Ok(*i),
            _ => anyhow::bail!(
                "expected one {what} in the plan, found {}: {events:#?}",
                found.len()
            ),
        }
    };
    let merged_at = one(
        &|e| e.kind == EventKind::Consolidated && op(e).as_deref() == Some("merged"),
        "merged memory",
    )?;
    let summary_at = one(
        &|e| e.kind == EventKind::Consolidated && op(e).as_deref() == Some("summary"),
        "session summary",
    )?;
    let superseded_at = one(&|e| e.kind == EventKind::Forgotten, "supersession")?;
    anyhow::ensure!(
        events.len() == 3,
        "the plan holds more than the merge, its supersession and the summary: {events:#?}"
    );
    let (merged, summary, superseded) = (
        &events[merged_at],
        &events[summary_at],
        &events[superseded_at],
    );
    // The merge names exactly the three tellings and counts them; the supersession hides
    // exactly those, by the merged memory.
    let ids = |v: &Value| -> BTreeSet<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let tellings: BTreeSet<String> = duplicates
        .iter()
        .map(|(_, _, e)| e.event_id.to_string())
        .collect();
    let merged_data = data_of(merged);
    let recurrences = merged_data["recurrences"].as_u64();
    anyhow::ensure!(
        ids(&merged_data["sources"]) == tellings && recurrences == Some(duplicates.len() as u64),
        "the merged memory names {} with {recurrences:?} recurrences, not the {} tellings",
        merged_data["sources"],
        duplicates.len()
    );
    let hidden = data_of(superseded);
    anyhow::ensure!(
        ids(&hidden["event_ids"]) == tellings
            && hidden["superseded_by"].as_str() == Some(merged.event_id.as_str()),
        "the supersession hides {} for {}, not the tellings for the merged memory",
        hidden["event_ids"],
        hidden["superseded_by"]
    );
    let summarised = ids(&data_of(summary)["sources"]);
    anyhow::ensure!(
        written
            .iter()
            .all(|(_, _, e)| summarised.contains(e.event_id.as_str())),
        "the session summary leaves out some of the session's memories: {summarised:?}"
    );
    let source_list = duplicates
        .iter()
        .map(|(who, seq, _)| format!("{who}'s seq {seq}"))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "  consolidate {session} (one run) -> {} events:",
        events.len()
    );
    println!(
        "    merged      seq={:<5} {}\n                sources: {source_list}; recurrences {}",
        seqs[merged_at],
        one_line(&merged.content.text, 70),
        duplicates.len()
    );
    println!(
        "    superseded  seq={:<5} the {} tellings, by the merged memory",
        seqs[superseded_at],
        tellings.len()
    );
    println!(
        "    summary     seq={:<5} {} (of {} memories)",
        seqs[summary_at],
        one_line(&summary.content.text, 70),
        summarised.len()
    );

    // Superseded, not deleted: retrieval shows the merged memory and none of its sources;
    // the log still holds every one.
    let done = seqs.iter().copied().max().unwrap_or(end.seq);
    let found = search(demo, &scopes, done).await?;
    let returned: BTreeSet<String> = found
        .results
        .iter()
        .chain(&found.summaries)
        .map(|r| r.event_id.to_string())
        .collect();
    anyhow::ensure!(
        returned.contains(merged.event_id.as_str())
            && returned.contains(summary.event_id.as_str())
            && returned.is_disjoint(&tellings),
        "retrieval after consolidation returned {returned:?}: not the merged memory and the summary without their sources"
    );
    let mut logged = BTreeSet::new();
    let filter = SubjectFilter::all()
        .tenant(demo.tenant.clone())
        .scope(session.kind, session.id.clone());
    let mut replay = demo
        .client
        .replay(&filter, StartAt::Seq(written[0].1))
        .await?;
    while let Some(item) = replay.next().await {
        logged.insert(item?.event.event_id.to_string());
    }
    anyhow::ensure!(
        tellings.is_subset(&logged),
        "a superseded telling is gone from the log"
    );
    println!(
        "  retrieve {LESSON:?} -> the merged memory and the summary, none of the {} tellings; a replay still holds all {}",
        tellings.len(),
        tellings.len()
    );

    // `engram consolidate --restore <id>` brings one telling back.
    let (who, seq, original) = &duplicates[1];
    let request = consolidate::request(
        scopes.clone(),
        Vec::new(),
        &[original.event_id.to_string()],
        after(done),
    )?;
    let (restored, receipts) = demo.client.consolidate(&request).await?;
    let (copy, back) = match (&restored[..], &receipts[..]) {
        ([copy], [Ok(receipt)]) => (copy, receipt.seq),
        _ => anyhow::bail!(
            "restoring {} planned {restored:?}: {receipts:?}",
            original.event_id
        ),
    };
    anyhow::ensure!(
        op(copy).as_deref() == Some("restored")
            && copy.causation_id.as_ref().map(|c| c.as_str()) == Some(original.event_id.as_str())
            && copy.content.text == original.content.text,
        "the restored copy does not name {}: {copy:?}",
        original.event_id
    );
    let found = search(demo, &scopes, back).await?;
    anyhow::ensure!(
        found
            .results
            .iter()
            .any(|r| r.event_id == copy.event_id && r.text == original.content.text),
        "the restored telling is not retrieved: {:?}",
        found.results
    );
    println!(
        "  consolidate --restore {} ({who}'s seq {seq}) -> seq={back}: retrieved again, as a copy naming it",
        original.event_id
    );
    Ok(())
}

fn data_of(event: &Envelope) -> &Value {
    event.content.data.as_ref().unwrap_or(&Value::Null)
}

/// The session's memories about the lesson, once `seq` is visible (keyword: what it finds
/// does not depend on the embedding model).
async fn search(
    demo: &Demo<'_>,
    scopes: &ScopeRequest,
    seq: u64,
) -> anyhow::Result<RetrieveResponse> {
    demo.client
        .retrieve(&RetrieveRequest {
            scopes: scopes.clone(),
            query: LESSON.into(),
            vector: None,
            top_k: 10,
            filter: MemoryFilter::default(),
            consistency: after(seq),
            mode: RetrievalMode::Keyword,
            ranking: None,
        })
        .await
        .context("retrieve")
}
