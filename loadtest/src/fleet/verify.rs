//! End-of-run verification against the stream and every projector.
//!
//! - **Stream:** every acknowledged event id must be stored exactly once, at the sequence its
//!   ack gave. Read with a raw ordered consumer over the run's part of the stream.
//! - **Projectors:** what each projector applied during the run (the difference between its
//!   apply ledger at the end and at the [`Baseline`]: a count and an order-independent digest
//!   of the (seq, event id) pairs, saved atomically with its state) must equal what is
//!   computed here from the stream between its baseline sequence and the sequence its final
//!   ledger reached, less the events it dead-lettered (read back from the dead-letter
//!   stream, not taken from the projector's word). An event skipped or applied twice, even
//!   across a `kill -9` and replay, changes it; so does an event neither applied nor
//!   dead-lettered.
//!
//! Each projector's final ledger is read before the stream, and the stream is read only up
//! to the sequence that ledger covers: events other clients append meanwhile are neither
//! expected of a projector nor counted against it.
//!
//! The baseline is what makes a remote deployment verifiable: its stream may hold history from
//! before the run, some of it already removed by retention limits, and reading only from the
//! baseline on neither depends on that history nor spends time reading it.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use engram_bus::Bus;
use engram_projection_runtime::ApplyLedger;
use futures::StreamExt;
use serde::Serialize;
use tokio::time::Instant;

use super::FleetError;
use super::record::Acked;
use super::sampler::projector_ledger;
use super::target::projectors;

/// What the verification found. Anything but zero in `lost`, `duplicated`,
/// `seq_mismatch`, and every projector's `lost` and `duplicated`, fails the run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Verification {
    /// Events acknowledged to the instances.
    pub acked: u64,
    /// Acknowledged but not in the stream.
    pub lost: u64,
    /// Acknowledged and stored more than once (the same event id at two sequences).
    pub duplicated: u64,
    /// Stored at another sequence than the ack said.
    pub seq_mismatch: u64,
    /// The stream's last sequence when the run started; everything after it is the run's.
    pub baseline_seq: u64,
    /// Messages stored after the baseline, and how many decoded as events.
    pub stream_messages: u64,
    pub stream_events: u64,
    /// Events of the load test's tenant in the stream that no instance saw acknowledged:
    /// appends abandoned by dying instances or failed during an outage. Not an error; an
    /// unacknowledged append may or may not be stored. Board pushes, consolidation outputs
    /// and the query service's usage reports are not appends the ledger holds, and are left
    /// out (they are counted in `tally`).
    pub stored_unacked: u64,
    /// What the run's part of the stream holds for the report: text memories, consolidation
    /// outputs, document changes.
    pub tally: super::consolidation::StreamTally,
    pub projectors: Vec<ProjectorCheck>,
    /// The teams' task boards: every pushed edit on the merged board, readers agreeing.
    #[serde(default)]
    pub docs: Option<super::docs::DocsCheck>,
    /// Examples of what went wrong, at most ten.
    pub examples: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProjectorCheck {
    pub projector: String,
    /// The projector's applied sequence at the baseline; it is checked on what came after.
    pub baseline_seq: u64,
    /// The sequence its final ledger covers: it is checked up to here.
    pub through_seq: u64,
    /// Events the stream holds in that range, less those it dead-lettered: what the projector
    /// should have applied.
    pub expected_events: u64,
    /// Events in that range the dead-letter stream holds a letter for, from this projector.
    pub dead_lettered: u64,
    /// Events the projector applied after its baseline.
    pub applied_events: u64,
    pub digest_matches: bool,
    /// Short of the stream (expected minus applied), when positive, plus messages in the range
    /// that no projector can apply (they do not decode) yet have no dead letter from it.
    pub lost: u64,
    /// Beyond the stream (applied minus expected), when positive; also 1 when the counts
    /// agree but the digests do not (something skipped and something applied twice).
    pub duplicated: u64,
    /// Set if the projector could not be asked.
    pub error: Option<String>,
}

impl Verification {
    pub fn failures(&self) -> u64 {
        self.lost
            + self.duplicated
            + self.seq_mismatch
            + self
                .projectors
                .iter()
                .map(|p| p.lost + p.duplicated + u64::from(p.error.is_some()))
                .sum::<u64>()
            + self
                .docs
                .as_ref()
                .map_or(0, super::docs::DocsCheck::failures)
    }

    fn example(&mut self, text: String) {
        if self.examples.len() < 10 {
            self.examples.push(text);
        }
    }
}

/// Where the stream and each projector stood before the load began.
#[derive(Clone, Debug, Default)]
pub struct Baseline {
    /// The dead-letter stream's last sequence: letters after it are the run's.
    pub dead_letter_seq: u64,
    /// The stream's last sequence.
    pub stream_seq: u64,
    /// Each projector's apply ledger; a projector missing here (it did not answer) is
    /// checked against the whole stream, as if it had applied nothing yet.
    pub projectors: HashMap<String, ApplyLedger>,
}

impl Baseline {
    /// Reads the dead-letter stream's last sequence, the stream's last sequence and every
    /// projector's ledger. Asked in that order, so that a projector still applying older
    /// events only lowers its own baseline, and so that every dead letter for an event after
    /// a projector's baseline comes after the dead-letter baseline: a projector moves its
    /// ledger past an event before it sends that event's letter.
    pub async fn take(bus: &Bus) -> Result<Baseline, FleetError> {
        let dead_letter_seq = bus
            .dead_letters_last_seq()
            .await
            .map_err(|e| FleetError::Verify(format!("reading the dead-letter stream: {e}")))?;
        let stream_seq = bus.stream_state().await?.last_seq;
        let mut ledgers = HashMap::new();
        for name in projectors() {
            match projector_ledger(bus.client(), name).await {
                Ok(answer) => {
                    ledgers.insert(name.to_owned(), answer.ledger);
                }
                Err(error) => {
                    tracing::warn!(projector = name, %error, "no baseline ledger; checking it against all the stream holds");
                }
            }
        }
        Ok(Baseline {
            dead_letter_seq,
            stream_seq,
            projectors: ledgers,
        })
    }

    fn projector(&self, name: &str) -> ApplyLedger {
        self.projectors.get(name).copied().unwrap_or_default()
    }

    /// The first sequence anything is checked from.
    fn first_seq(&self) -> u64 {
        projectors()
            .into_iter()
            .map(|name| self.projector(name).seq)
            .fold(self.stream_seq, u64::min)
            + 1
    }
}

/// How the drain went: how long until every projector had applied the stream as it stood
/// when the drain began, and when each first had.
#[derive(Clone, Debug, Default)]
pub struct Drained {
    pub took: Duration,
    /// Per projector, from the drain's start until its visible sequence first reached the
    /// drain's target.
    pub caught_up: std::collections::BTreeMap<String, Duration>,
}

/// Waits until every projector has made visible the stream's last sequence as of now, printing
/// progress; returns how long that took, or an error naming the projectors still behind.
///
/// The target is fixed when the drain begins: everything the caller wrote is in the stream by
/// then. Chasing the stream's tip instead never ended on a deployment others keep writing to
/// (or whose consolidator appends its outputs meanwhile): a projector that commits in batches
/// is always a few events behind a moving tip, so all of them were rarely at it at once.
pub async fn drain(bus: &Bus, limit: Duration) -> Result<Drained, FleetError> {
    let started = Instant::now();
    let mut last_print = Instant::now();
    let mut caught_up = std::collections::BTreeMap::new();
    let last = bus.stream_state().await?.last_seq;
    loop {
        let mut behind = Vec::new();
        for name in projectors() {
            match projector_ledger(bus.client(), name).await {
                Ok(l) if l.visible_seq >= last => {
                    caught_up
                        .entry(name.to_owned())
                        .or_insert_with(|| started.elapsed());
                }
                Ok(l) => behind.push(format!("{name} at {} of {last}", l.visible_seq)),
                Err(e) => behind.push(format!("{name} not answering ({e})")),
            }
        }
        if behind.is_empty() {
            return Ok(Drained {
                took: started.elapsed(),
                caught_up,
            });
        }
        if started.elapsed() >= limit {
            return Err(FleetError::Drain(format!(
                "projectors still behind after {limit:?}: {}",
                behind.join(", ")
            )));
        }
        if last_print.elapsed() >= Duration::from_secs(2) {
            eprintln!(
                "[drain] {:>4.0}s  waiting for projectors: {}",
                started.elapsed().as_secs_f64(),
                behind.join(", ")
            );
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How long verification waits for a projector's ledger to settle (everything it applied is
/// also published, so its dead letters are sent) while other clients keep appending.
const SETTLE_LIMIT: Duration = Duration::from_secs(30);

/// A projector's ledger, returned once everything it counts is published: its visible
/// sequence has reached the ledger's sequence. Only then are the dead letters of every event
/// up to that sequence sent (a projector sends them before it publishes), so the dead-letter
/// stream can be read against the ledger.
///
/// The ledger and its visible sequence come from the same answer. A model's ledger is its
/// partitions' summed, at the highest partition's sequence: read while one partition was
/// still behind, it lacks that partition's events below that sequence, which it applies
/// later. Keeping that first ledger and waiting only for the visible sequence (as this did)
/// then counted those events lost, in runs where the vector projector finished last.
pub(crate) async fn settled_ledger(bus: &Bus, name: &str) -> Result<ApplyLedger, String> {
    let deadline = Instant::now() + SETTLE_LIMIT;
    loop {
        let last = match projector_ledger(bus.client(), name).await {
            Ok(answer) if answer.visible_seq >= answer.ledger.seq => return Ok(answer.ledger),
            Ok(answer) => format!(
                "its ledger at seq {} was still ahead of its visible seq {}",
                answer.ledger.seq, answer.visible_seq
            ),
            Err(e @ engram_rpc::RpcError::NoResponders { .. }) => return Err(e.to_string()),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(format!("no settled ledger within {SETTLE_LIMIT:?}: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What one projector is checked against, built while the stream is read.
struct Expectation {
    name: &'static str,
    /// Checked after this sequence (its baseline)...
    from: u64,
    /// ...up to this one (its final ledger), or why it could not be asked.
    through: Result<ApplyLedger, String>,
    /// Event sequences the dead-letter stream holds a letter for, from this projector.
    letters: HashSet<u64>,
    expected: ApplyLedger,
    dead_lettered: u64,
    /// Messages that do not decode, have no letter, and so went nowhere.
    unaccounted: u64,
}

impl Expectation {
    fn covers(&self, seq: u64) -> bool {
        seq > self.from && self.through.as_ref().is_ok_and(|l| seq <= l.seq)
    }
}

/// Reads the stream from the baseline on and checks the ledger and the projectors against it.
pub async fn verify(
    bus: &Bus,
    ledger: &[Acked],
    tenant: &str,
    baseline: &Baseline,
) -> Result<Verification, FleetError> {
    let mut result = Verification {
        acked: ledger.len() as u64,
        baseline_seq: baseline.stream_seq,
        ..Verification::default()
    };
    let read = |e: &dyn std::fmt::Display| FleetError::Verify(format!("reading the stream: {e}"));
    // First the projectors' final ledgers, then the dead letters sent up to them, then the
    // stream up to where they reach.
    let mut expectations = Vec::with_capacity(projectors().len());
    for name in projectors() {
        expectations.push(Expectation {
            name,
            from: baseline.projector(name).seq,
            through: settled_ledger(bus, name).await,
            letters: HashSet::new(),
            expected: ApplyLedger::default(),
            dead_lettered: 0,
            unaccounted: 0,
        });
    }
    let letters = bus
        .dead_letter_refs(baseline.dead_letter_seq)
        .await
        .map_err(|e| FleetError::Verify(format!("reading the dead-letter stream: {e}")))?;
    for letter in letters {
        if let (Some(e), Some(seq)) = (
            expectations.iter_mut().find(|e| e.name == letter.projector),
            letter.event_seq,
        ) {
            e.letters.insert(seq);
        }
    }
    let last_acked = ledger.iter().map(|a| a.seq).max().unwrap_or(0);
    let through = expectations
        .iter()
        .filter_map(|e| e.through.as_ref().ok().map(|l| l.seq))
        .fold(last_acked.max(baseline.stream_seq), u64::max);

    let consumer = crate::project::stream_from(bus, baseline.first_seq())
        .await
        .map_err(|e| read(&e))?;
    // event id -> sequences it is stored at.
    let mut stored: HashMap<String, Vec<u64>> = HashMap::with_capacity(ledger.len() * 2);
    let mut ours = 0u64;
    if let Some(consumer) = consumer {
        let mut messages = consumer.messages().await.map_err(|e| read(&e))?;
        while let Some(message) = messages.next().await {
            let message = message.map_err(|e| read(&e))?;
            let info = message.info().map_err(|e| read(&e))?;
            let (seq, pending) = (info.stream_sequence, info.pending);
            if seq > through {
                break;
            }
            let in_run = seq > baseline.stream_seq;
            result.stream_messages += u64::from(in_run);
            let event = bus.codec().decode(&message.payload).ok();
            for e in expectations.iter_mut().filter(|e| e.covers(seq)) {
                if e.letters.contains(&seq) {
                    e.dead_lettered += 1;
                } else if let Some(event) = &event {
                    e.expected.add(seq, event.event_id.as_str());
                } else {
                    e.unaccounted += 1;
                }
            }
            if let Some(event) = event
                && in_run
            {
                result.stream_events += 1;
                if event.tenant.as_str() == tenant {
                    ours += u64::from(result.tally.add(&event));
                }
                stored
                    .entry(event.event_id.as_str().to_owned())
                    .or_default()
                    .push(seq);
            }
            if pending == 0 || seq == through {
                break;
            }
        }
    }
    let mut acked_ids = std::collections::HashSet::with_capacity(ledger.len());
    for entry in ledger {
        if !acked_ids.insert(entry.event_id.as_str()) {
            // Two acks for one id can only come from a retry the SDK reported twice.
            continue;
        }
        match stored.get(&entry.event_id).map(Vec::as_slice) {
            None | Some([]) => {
                result.lost += 1;
                result.example(format!(
                    "lost: {} acked at seq {}",
                    entry.event_id, entry.seq
                ));
            }
            Some([seq]) if *seq == entry.seq => {}
            Some([seq]) => {
                result.seq_mismatch += 1;
                result.example(format!(
                    "{} acked at seq {} but stored at {seq}",
                    entry.event_id, entry.seq
                ));
            }
            Some(seqs) => {
                result.duplicated += 1;
                result.example(format!("duplicated: {} at seqs {seqs:?}", entry.event_id));
            }
        }
    }
    result.stored_unacked = ours.saturating_sub(acked_ids.len() as u64);
    result.tally.finish();
    for e in &expectations {
        if e.unaccounted > 0 {
            result.example(format!(
                "projector {}: {} messages that do not decode have no dead letter from it",
                e.name, e.unaccounted
            ));
        }
        result
            .projectors
            .push(check_projector(e, &baseline.projector(e.name), last_acked));
    }
    Ok(result)
}

fn check_projector(e: &Expectation, baseline: &ApplyLedger, last_acked: u64) -> ProjectorCheck {
    let mut check = ProjectorCheck {
        projector: e.name.to_owned(),
        baseline_seq: baseline.seq,
        through_seq: 0,
        expected_events: e.expected.events,
        dead_lettered: e.dead_lettered,
        applied_events: 0,
        digest_matches: false,
        lost: 0,
        duplicated: 0,
        error: None,
    };
    let end = match &e.through {
        Ok(end) => end,
        Err(error) => {
            check.error = Some(error.clone());
            return check;
        }
    };
    check.through_seq = end.seq;
    if end.events < baseline.events {
        check.error = Some(format!(
            "its ledger went back from {} to {} events: was it rebuilt during the run?",
            baseline.events, end.events
        ));
        return check;
    }
    if end.seq < last_acked {
        check.error = Some(format!(
            "it had applied only up to seq {}, short of the run's last acknowledged seq {last_acked}",
            end.seq
        ));
        return check;
    }
    // Sums, so the run's share is a difference; wrapping, like the digest itself.
    let applied = ApplyLedger {
        seq: end.seq,
        events: end.events.wrapping_sub(baseline.events),
        digest: end.digest.wrapping_sub(baseline.digest),
    };
    check.applied_events = applied.events;
    check.digest_matches = applied.digest == e.expected.digest;
    check.lost = e.expected.events.saturating_sub(applied.events) + e.unaccounted;
    check.duplicated = applied.events.saturating_sub(e.expected.events);
    if check.lost == 0 && check.duplicated == 0 && !check.digest_matches {
        check.duplicated = 1;
    }
    check
}
