//! Snapshot cuts under load and after it: every `snapshot_every` during the load the run
//! asks each projector for an on-demand snapshot (`engram.p.<projector>.snapshot`), so that
//! successors have snapshots to bootstrap from, as a deployment's periodic cuts give them;
//! once the stream is verified it asks each for one more, the cut the report gives per
//! projector. Each request is timed here, from asking to the stored snapshot's answer.
//!
//! Cuts are unlabelled: a remote deployment's retention removes them like its own periodic
//! ones. A projector whose model cannot export itself refuses (`invalid`); it is asked
//! no more and reported as such.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use engram_memory::proto::{ErrorCode, partition_subject};
use engram_projectors::SnapshotRequest;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use super::target::projectors;

/// How long one cut may take: a cut exports the whole model.
const CUT_TIMEOUT: Duration = Duration::from_secs(300);

/// The part of a projector's answer (the stored snapshot's metadata) the report uses.
#[derive(Clone, Debug, Deserialize)]
struct Stored {
    version: u64,
    events: u64,
    bytes: u64,
    created_at: DateTime<Utc>,
}

/// One cut, as the run saw it.
#[derive(Clone, Debug, Serialize)]
pub struct Cut {
    /// Seconds from the request to the answer: export, upload, index, retention.
    pub secs: f64,
    pub bytes: u64,
    /// The stream sequence the snapshot holds everything up to.
    pub version: u64,
    pub events: u64,
    /// False when the projector answered with a snapshot it already had (nothing applied
    /// since): then `secs` is no cut's time.
    pub fresh: bool,
}

/// One projector's cuts.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProjectorSnapshots {
    pub projector: String,
    /// Cuts requested during the load that succeeded, and their seconds.
    pub cuts_during_load: u64,
    pub cut_secs_p50_during_load: Option<f64>,
    pub cut_secs_max_during_load: Option<f64>,
    /// The cut after the run.
    pub final_cut: Option<Cut>,
    /// Why the projector keeps no snapshots (its model cannot export itself), if so.
    pub refused: Option<String>,
    /// Failed requests (timeouts, unavailable) and the first failure's message.
    pub failures: u64,
    pub first_failure: Option<String>,
    /// The seconds of the cuts during the load, for the median and max.
    #[serde(skip)]
    secs_during_load: Vec<f64>,
}

/// What the cuts found so far, shared by the cutter during the load and the final cut.
#[derive(Clone, Default)]
pub(crate) struct Cuts(Arc<Mutex<BTreeMap<String, ProjectorSnapshots>>>);

impl Cuts {
    fn with<T>(&self, projector: &str, f: impl FnOnce(&mut ProjectorSnapshots) -> T) -> T {
        let mut all = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(all
            .entry(projector.to_owned())
            .or_insert_with(|| ProjectorSnapshots {
                projector: projector.to_owned(),
                ..ProjectorSnapshots::default()
            }))
    }

    fn refused(&self, projector: &str) -> bool {
        self.with(projector, |p| p.refused.is_some())
    }

    /// Asks `projector` for a cut and records the answer; the cut if one came.
    async fn cut(&self, client: &async_nats::Client, projector: &str) -> Option<Cut> {
        let requested_at = Utc::now();
        let started = Instant::now();
        // Every partition's instance cuts its own, all at once: the model's cut is theirs
        // together (the load test provisions the default partitions).
        let cuts = (0..engram_schema::DEFAULT_PARTITIONS).map(|p| {
            let subject = partition_subject(projector, "snapshot", p);
            async move {
                engram_rpc::call::<_, Stored>(
                    client,
                    &subject,
                    &SnapshotRequest::default(),
                    CUT_TIMEOUT,
                )
                .await
            }
        });
        let answer: Result<Vec<Stored>, engram_rpc::RpcError> =
            futures::future::join_all(cuts).await.into_iter().collect();
        let secs = started.elapsed().as_secs_f64();
        match answer {
            Ok(parts) => Some(Cut {
                secs,
                bytes: parts.iter().map(|s| s.bytes).sum(),
                version: parts.iter().map(|s| s.version).max().unwrap_or(0),
                events: parts.iter().map(|s| s.events).sum(),
                // A second of slack for the two clocks of a remote deployment.
                fresh: parts
                    .iter()
                    .any(|s| s.created_at + chrono::TimeDelta::seconds(1) >= requested_at),
            }),
            Err(e) if e.code() == ErrorCode::Invalid => {
                self.with(projector, |p| p.refused = Some(e.to_string()));
                None
            }
            Err(e) => {
                self.with(projector, |p| {
                    p.failures += 1;
                    p.first_failure.get_or_insert_with(|| e.to_string());
                });
                None
            }
        }
    }

    /// A cut during the load, for every projector that has not refused.
    pub(crate) async fn cut_all_during_load(&self, client: &async_nats::Client) {
        for projector in projectors() {
            if self.refused(projector) {
                continue;
            }
            if let Some(cut) = self.cut(client, projector).await {
                self.with(projector, |p| {
                    p.cuts_during_load += 1;
                    p.secs_during_load.push(cut.secs);
                });
            }
        }
    }

    /// The final cut of every projector, and what each projector's cuts came to.
    pub(crate) async fn finish(&self, client: &async_nats::Client) -> Vec<ProjectorSnapshots> {
        for projector in projectors() {
            if let Some(cut) = self.cut(client, projector).await {
                self.with(projector, |p| p.final_cut = Some(cut));
            }
        }
        projectors()
            .into_iter()
            .map(|projector| {
                self.with(projector, |p| {
                    p.secs_during_load.sort_by(f64::total_cmp);
                    let secs = &p.secs_during_load;
                    p.cut_secs_p50_during_load = secs.get(secs.len() / 2).copied();
                    p.cut_secs_max_during_load = secs.last().copied();
                    p.clone()
                })
            })
            .collect()
    }
}

/// Cuts every projector each `every` from `start` until `stop` turns true; `every` zero
/// cuts nothing.
pub(crate) async fn run_during_load(
    client: async_nats::Client,
    cuts: Cuts,
    start: Instant,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    if every.is_zero() {
        return;
    }
    let mut tick = tokio::time::interval_at(start + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        tokio::select! {
            () = cuts.cut_all_during_load(&client) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
