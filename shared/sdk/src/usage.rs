//! Use reports, aggregated: [`UsageReporter`].
//!
//! An agent that reports the memories each step used (so that the consolidator reinforces
//! them) would, with [`Agent::used`], append one event per step. A [`UsageReporter`]
//! buffers the reports instead and appends one `feedback {used: [...]}` event per scope
//! every interval, or as soon as a scope has [`MAX_USED`] ids waiting. Nothing is lost in
//! the aggregation: each report's ids are listed once per report, so a memory used in 20
//! steps is listed 20 times and counts 20 uses, as 20 calls of [`Agent::used`] would.
//!
//! Events are appended with the client's retries, by the same id. An event the stream did
//! not acknowledge is kept and appended again (same id, so stored once) on the next flush.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use engram_bus::{AppendError, AppendReceipt};
use engram_schema::payload::MAX_FORGOTTEN;
use engram_schema::{Content, Envelope, EventId, EventKind, Layer, Scope};
use tokio::sync::{Notify, oneshot};

use crate::Agent;

/// Most ids one use report lists (the payload's bound); a scope with this many waiting is
/// flushed at once.
pub const MAX_USED: usize = MAX_FORGOTTEN;
/// Events kept for another attempt when the stream did not take them; past this the oldest
/// are dropped (with a warning).
pub const MAX_UNSENT: usize = 1_000;

/// Buffers use reports and appends them aggregated: one event per scope per flush. Made by
/// [`Agent::usage_reporter`].
///
/// It flushes every interval (on a task of its own), when a scope reaches [`MAX_USED`] ids,
/// on [`UsageReporter::flush`], and once more when closed or dropped. Dropping it only
/// starts that last flush: await [`UsageReporter::close`] (or `flush`) before the program
/// exits, or what is buffered may be lost.
#[derive(Debug)]
pub struct UsageReporter {
    shared: Arc<Shared>,
    /// Dropped with the reporter, which tells its task to flush a last time and end.
    _closing: oneshot::Sender<()>,
}

#[derive(Debug)]
struct Shared {
    agent: Agent,
    buffer: Mutex<HashMap<Scope, Batch>>,
    /// Built but not acknowledged events, appended again (same ids) first on the next
    /// flush. The lock also keeps two flushes from running at once.
    unsent: tokio::sync::Mutex<Vec<Envelope>>,
    /// Wakes the task when a scope has [`MAX_USED`] ids waiting.
    full: Notify,
}

/// One scope's reports since the last flush.
#[derive(Debug)]
struct Batch {
    ids: Vec<EventId>,
    /// When the latest report came: the events' `occurred_at`, from which decay restarts.
    latest: DateTime<Utc>,
}

impl Agent {
    /// A reporter that aggregates [`UsageReporter::used`] reports into one `feedback`
    /// event per scope every `every` (0: only when a scope is full, or on `flush`). Needs a
    /// Tokio runtime: its flushes run on a task of their own.
    pub fn usage_reporter(&self, every: Duration) -> UsageReporter {
        let shared = Arc::new(Shared {
            agent: self.clone(),
            buffer: Mutex::new(HashMap::new()),
            unsent: tokio::sync::Mutex::new(Vec::new()),
            full: Notify::new(),
        });
        let (closing, closed) = oneshot::channel();
        tokio::spawn(run(shared.clone(), every, closed));
        UsageReporter {
            shared,
            _closing: closing,
        }
    }
}

impl UsageReporter {
    /// Reports that one step used these memories of `scope`. Never waits: the report is
    /// buffered until the next flush. An id named twice in one report counts once.
    pub fn used(&self, scope: Scope, event_ids: &[EventId]) {
        if event_ids.is_empty() {
            return;
        }
        let mut seen = BTreeSet::new();
        let full = {
            let mut buffer = self.shared.buffer.lock().unwrap_or_else(|e| e.into_inner());
            let batch = buffer.entry(scope).or_insert_with(|| Batch {
                ids: Vec::new(),
                latest: Utc::now(),
            });
            batch
                .ids
                .extend(event_ids.iter().filter(|id| seen.insert(*id)).cloned());
            batch.latest = Utc::now();
            batch.ids.len() >= MAX_USED
        };
        if full {
            self.shared.full.notify_one();
        }
    }

    /// Appends everything buffered now, one event per scope (more for a scope past
    /// [`MAX_USED`] ids), and returns their receipts. On an error the events not stored
    /// are kept for the next flush, to be appended by the same ids.
    pub async fn flush(&self) -> Result<Vec<AppendReceipt>, AppendError> {
        self.shared.flush().await
    }

    /// Flushes, and stops the reporter's task.
    pub async fn close(self) -> Result<Vec<AppendReceipt>, AppendError> {
        self.shared.flush().await
    }
}

impl Shared {
    async fn flush(&self) -> Result<Vec<AppendReceipt>, AppendError> {
        let mut unsent = self.unsent.lock().await;
        let taken = std::mem::take(&mut *self.buffer.lock().unwrap_or_else(|e| e.into_inner()));
        for (scope, batch) in taken {
            for chunk in batch.ids.chunks(MAX_USED) {
                unsent.push(self.event(scope.clone(), chunk, batch.latest));
            }
        }
        if unsent.len() > MAX_UNSENT {
            let over = unsent.len() - MAX_UNSENT;
            unsent.drain(..over);
            tracing::warn!(
                dropped = over,
                "use reports dropped: the stream has not taken them"
            );
        }
        if unsent.is_empty() {
            return Ok(Vec::new());
        }
        let events = std::mem::take(&mut *unsent);
        let results = self.agent.client.append_batch(&events).await;
        let (mut receipts, mut error) = (Vec::new(), None);
        for (event, result) in events.into_iter().zip(results) {
            match result {
                Ok(receipt) => receipts.push(receipt),
                Err(e) => {
                    if e.is_retryable() {
                        unsent.push(event);
                    } else {
                        tracing::error!(event_id = %event.event_id, scope = %event.scope, error = %e, "use report refused");
                    }
                    error.get_or_insert(e);
                }
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(receipts),
        }
    }

    /// One use report: episodic `feedback` with empty text, so that no read model takes it
    /// for a memory of its own.
    fn event(&self, scope: Scope, ids: &[EventId], at: DateTime<Utc>) -> Envelope {
        let ids: Vec<&str> = ids.iter().map(EventId::as_str).collect();
        let mut event = Envelope::new(
            self.agent.tenant.clone(),
            scope,
            self.agent.agent_id.clone(),
            self.agent.instance_id.clone(),
            Layer::Episodic,
            EventKind::Feedback,
            Content {
                text: String::new(),
                data: Some(serde_json::json!({ "used": ids })),
            },
        );
        event.occurred_at = at;
        event
    }
}

/// Flushes every `every` and when a scope is full, until the reporter is dropped; then
/// once more.
async fn run(shared: Arc<Shared>, every: Duration, mut closed: oneshot::Receiver<()>) {
    let mut ticker = (!every.is_zero()).then(|| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    loop {
        let closing = tokio::select! {
            _ = async {
                match &mut ticker {
                    Some(t) => t.tick().await,
                    None => std::future::pending().await,
                }
            } => false,
            () = shared.full.notified() => false,
            _ = &mut closed => true,
        };
        if let Err(e) = shared.flush().await {
            tracing::warn!(error = %e, "use reports not appended; they are kept for the next flush");
        }
        if closing {
            return;
        }
    }
}
