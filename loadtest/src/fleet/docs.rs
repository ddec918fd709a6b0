//! Shared documents under load: every team edits its task board concurrently, each
//! instance through its own copy; a share of the instances works offline for the middle of
//! the run and sends its edits late. At the end every pushed edit must be on the merged
//! board, and every reader must hold the same board.
//!
//! An edit adds an item of the instance's own (`<instance>-<step>`), notes the team's
//! shared item and claims its owner field, which instances set concurrently: those claims
//! are the conflicts the board must expose. Only acknowledged pushes are expected; edits an
//! instance made and never pushed before it died are lost with it, as a crashed agent's are.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine as _;
use engram_memory::proto::{Consistency, DocRead, DocRequest, ScopeRequest};
use engram_schema::{Ident, Scope};
use engram_sdk::Client;
use engram_sdk::doc::{DocType, LocalDoc, SharedDoc, TaskBoard, TaskItem, TaskStatus};
use serde::Serialize;
use tokio::time::Instant;

/// The board every team edits.
pub const BOARD: &str = "sprint";
/// The item every instance of a team claims.
const SHARED_ITEM: &str = "team-goal";

/// One board's tenant and scope, and the items pushed to it.
type Pushed = (Ident, Scope, BTreeSet<String>);

/// What the instances pushed, for the check at the end.
#[derive(Default)]
pub(crate) struct Boards {
    /// Per board (`tenant/scope`).
    pushed: Mutex<BTreeMap<String, Pushed>>,
    pushes: AtomicU64,
    late_pushes: AtomicU64,
    edits: AtomicU64,
}

impl Boards {
    fn record(&self, tenant: &Ident, scope: &Scope, items: Vec<String>, late: bool) {
        self.pushes.fetch_add(1, Ordering::Relaxed);
        if late {
            self.late_pushes.fetch_add(1, Ordering::Relaxed);
        }
        let mut pushed = self.pushed.lock().unwrap_or_else(|p| p.into_inner());
        pushed
            .entry(format!("{tenant}/{scope}"))
            .or_insert_with(|| (tenant.clone(), scope.clone(), BTreeSet::new()))
            .2
            .extend(items);
    }
}

/// One instance's copy of its team's board.
pub(crate) struct Board {
    doc: SharedDoc<TaskBoard>,
    /// Items edited locally and not yet acknowledged.
    unpushed: Vec<String>,
    /// While now is in here, the instance is offline: it edits without pushing.
    offline: Option<(Instant, Instant)>,
    was_offline: bool,
}

impl Board {
    pub(crate) async fn open(
        agent: &engram_sdk::Agent,
        scope: Scope,
        offline: Option<(Instant, Instant)>,
    ) -> Result<Self, engram_sdk::doc::DocClientError> {
        Ok(Self {
            doc: agent.open_doc::<TaskBoard>(scope, BOARD, None).await?,
            unpushed: Vec::new(),
            offline,
            was_offline: false,
        })
    }

    /// One edit; pushed at once unless the instance is offline.
    pub(crate) async fn edit(
        &mut self,
        boards: &Boards,
        tenant: &Ident,
        scope: &Scope,
        instance: &str,
        step: u64,
    ) -> Result<(), engram_sdk::doc::DocClientError> {
        let item = format!("{instance}-{step}");
        self.doc.edit(|b| {
            b.items.insert(
                item.clone(),
                TaskItem {
                    title: format!("work of {instance} at step {step}"),
                    owner: Some(instance.to_owned()),
                    status: TaskStatus::Doing,
                    notes: Vec::new(),
                },
            );
            let goal = b.items.entry(SHARED_ITEM.to_owned()).or_default();
            goal.owner = Some(instance.to_owned());
            goal.notes.push(format!("{instance} step {step}"));
        })?;
        boards.edits.fetch_add(1, Ordering::Relaxed);
        self.unpushed.push(item);
        let now = Instant::now();
        if self
            .offline
            .is_some_and(|(from, to)| now >= from && now < to)
        {
            self.was_offline = true;
            return Ok(());
        }
        self.push(boards, tenant, scope).await
    }

    /// Sends what is unpushed (the instance is back, or the run ends).
    pub(crate) async fn push(
        &mut self,
        boards: &Boards,
        tenant: &Ident,
        scope: &Scope,
    ) -> Result<(), engram_sdk::doc::DocClientError> {
        if self.unpushed.is_empty() {
            return Ok(());
        }
        self.doc.push().await?;
        boards.record(
            tenant,
            scope,
            std::mem::take(&mut self.unpushed),
            self.was_offline,
        );
        self.was_offline = false;
        Ok(())
    }
}

/// The end-of-run check of the boards.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DocsCheck {
    pub boards: u64,
    pub edits: u64,
    pub pushes: u64,
    /// Pushes of instances that had been offline: edits sent late.
    pub late_pushes: u64,
    pub items_expected: u64,
    /// Pushed items missing from the merged board.
    pub items_missing: u64,
    /// Boards whose service view and a fresh reader's copy differ.
    pub readers_disagree: u64,
    /// Fields with concurrent values on the merged boards (the claims of the shared item).
    pub conflicts: u64,
    /// Changes held back for missing dependencies at the end (should be 0).
    pub held: u64,
    /// Time to read and check every board.
    pub check_secs: f64,
    pub examples: Vec<String>,
}

impl DocsCheck {
    pub fn failures(&self) -> u64 {
        self.items_missing + self.readers_disagree + self.held
    }
}

/// Reads every board the instances pushed to once `min_seq` is visible: each pushed item
/// must be on it, and a reader loading the compacted board must hold what the service shows.
pub(crate) async fn verify(client: &Client, boards: &Boards, min_seq: u64) -> DocsCheck {
    let started = std::time::Instant::now();
    let pushed = boards
        .pushed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut check = DocsCheck {
        edits: boards.edits.load(Ordering::Relaxed),
        pushes: boards.pushes.load(Ordering::Relaxed),
        late_pushes: boards.late_pushes.load(Ordering::Relaxed),
        ..DocsCheck::default()
    };
    let example = |check: &mut DocsCheck, text: String| {
        if check.examples.len() < 10 {
            check.examples.push(text);
        }
    };
    for (key, (tenant, scope, items)) in pushed {
        check.boards += 1;
        check.items_expected += items.len() as u64;
        let request = DocRequest {
            scopes: ScopeRequest {
                tenant,
                scope,
                grants: Vec::new(),
            },
            read: DocRead::State,
            doc_type: Ident::parse("doc_type", TaskBoard::TYPE).ok(),
            name: Ident::parse("name", BOARD).ok(),
            include_bytes: true,
            include_values: false,
            limit: 1,
            consistency: Consistency {
                min_seq: Some(min_seq),
                wait_ms: Some(30_000),
            },
        };
        let response = match client.doc(&request).await {
            Ok(r) => r,
            Err(e) => {
                check.items_missing += items.len() as u64;
                example(
                    &mut check,
                    format!("{key}: the board could not be read: {e}"),
                );
                continue;
            }
        };
        let Some(summary) = response.doc else {
            check.items_missing += items.len() as u64;
            example(
                &mut check,
                format!("{key}: no board, yet {} items were pushed", items.len()),
            );
            continue;
        };
        check.held += summary.held as u64;
        check.conflicts += response.conflicts.len() as u64;
        let on_board = summary
            .value
            .as_ref()
            .and_then(|v| v.get("items"))
            .and_then(|v| v.as_object());
        let missing: Vec<&String> = items
            .iter()
            .filter(|i| on_board.is_none_or(|b| !b.contains_key(i.as_str())))
            .collect();
        if !missing.is_empty() {
            check.items_missing += missing.len() as u64;
            example(
                &mut check,
                format!(
                    "{key}: {} pushed items missing, e.g. {}",
                    missing.len(),
                    missing[0]
                ),
            );
        }
        // A second reader: the compacted board loaded as an instance's copy.
        let agrees = response
            .bytes
            .as_deref()
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            .and_then(|bytes| LocalDoc::load(&bytes).ok())
            .is_some_and(|mut copy| {
                let mut heads: Vec<String> = copy.heads().iter().map(engram_docs::hex).collect();
                heads.sort();
                heads == summary.heads && Some(&copy.view().value) == summary.value.as_ref()
            });
        if !agrees {
            check.readers_disagree += 1;
            example(
                &mut check,
                format!("{key}: a reader's copy differs from the service's board"),
            );
        }
    }
    check.check_secs = started.elapsed().as_secs_f64();
    check
}
