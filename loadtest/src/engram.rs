//! Phase 1: simulated agents append realistic events through the SDK, as real agents do.
//!
//! Each agent records the encoded size and subject of every measured event, in order: that
//! trace is what the raw phase replays, so both phases move exactly the same bytes.

use engram_schema::{Envelope, subject_for};
use engram_sdk::Client;

use crate::driver::{Outcome, Sender};
use crate::workload::AgentWorkload;

/// Prefix of engram subjects, replaced by the raw stream's prefix in a trace.
const ENGRAM_PREFIX: &str = "engram.evt.";
/// What the raw stream captures; subjects below it mirror the engram ones token for token.
pub(crate) const RAW_SUBJECT_PREFIX: &str = "bench.raw.";

/// The sizes and subjects one agent appended, for the raw phase to replay.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    /// Distinct raw subjects; an agent writes to at most eight (two scopes, four layers).
    pub(crate) subjects: Vec<String>,
    /// Per measured event: index into `subjects`, and the encoded envelope size in bytes.
    pub(crate) events: Vec<(u8, u32)>,
}

impl Trace {
    fn push(&mut self, engram_subject: &str, size: usize) {
        let raw = format!(
            "{RAW_SUBJECT_PREFIX}{}",
            engram_subject
                .strip_prefix(ENGRAM_PREFIX)
                .unwrap_or(engram_subject)
        );
        let slot = match self.subjects.iter().position(|s| *s == raw) {
            Some(slot) => slot,
            None => {
                self.subjects.push(raw);
                self.subjects.len() - 1
            }
        };
        let slot = u8::try_from(slot).expect("an agent writes to at most eight subjects");
        let size = u32::try_from(size).expect("events are far below 4 GiB");
        self.events.push((slot, size));
    }
}

/// Events generated per agent before the phase starts, then cycled with fresh ids.
///
/// Generating an event (word sampling, `format!`) cost about 9 us of CPU, a fifth of the agent
/// side in profiles; the raw phase has no such cost, so generating inside the phase charged
/// the benchmark's own work to Engram. Cycling a pre-built pool leaves a clone and new ids.
const POOL: usize = 128;

/// One simulated agent instance of the engram phase.
pub(crate) struct EngramAgent {
    /// A clone of the client for this agent's connection from the pool.
    client: Client,
    pool: Vec<Envelope>,
    next: usize,
    /// Filled from receipts in `send`, which takes `&self`; only this agent's task touches it,
    /// so the lock is never contended.
    trace: std::sync::Mutex<Trace>,
}

impl EngramAgent {
    pub(crate) fn new(client: Client, mut workload: AgentWorkload) -> Self {
        Self {
            client,
            pool: (0..POOL).map(|_| workload.next_event()).collect(),
            next: 0,
            trace: std::sync::Mutex::new(Trace::default()),
        }
    }

    pub(crate) fn into_trace(self) -> Trace {
        self.trace
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// An event ready to append, and whether its size belongs in the trace.
pub(crate) type Prepared = (Envelope, bool);

impl Sender for EngramAgent {
    type Item = Prepared;

    fn prepare(&mut self, measured: bool) -> Prepared {
        let mut event = self.pool[self.next % POOL].clone();
        self.next += 1;
        // A fresh id, or the stream would deduplicate the second lap; fresh times, as a live
        // agent would stamp them.
        let age = event.recorded_at - event.occurred_at;
        event.event_id = engram_schema::EventId::new();
        event.recorded_at = chrono::Utc::now();
        event.occurred_at = event.recorded_at - age;
        (event, measured)
    }

    async fn send(&self, (event, measured): Prepared) -> Outcome {
        match self.client.append(&event).await {
            Ok(receipt) => {
                // The receipt carries the encoded size, so the raw replay is byte-exact
                // without encoding the event a second time.
                if measured {
                    let mut trace = self
                        .trace
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    trace.push(&subject_for(&event), receipt.bytes);
                }
                Outcome::Stored {
                    bytes: receipt.bytes,
                    duplicate: receipt.duplicate,
                }
            }
            Err(e) => Outcome::Failed {
                kind: e.kind(),
                message: e.to_string(),
            },
        }
    }
}
