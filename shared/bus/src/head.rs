//! The events stream's last sequence, as far as a reader needs it: to tell a read-your-writes
//! token that some append returned from one that no append can have returned.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Bus, BusError};

/// The highest sequence known to exist in the events stream. Asks the server only when a
/// caller names a sequence above it: a direct get of the event there, and only when none is
/// found a stream-info request, one at a time; so a flood of impossible tokens costs two
/// requests each (the second queued), bounded by the caller's in-flight limit.
#[derive(Debug)]
pub struct StreamHead {
    bus: Bus,
    known: AtomicU64,
    refresh: tokio::sync::Mutex<()>,
}

impl StreamHead {
    pub fn new(bus: Bus) -> Self {
        Self {
            bus,
            known: AtomicU64::new(0),
            refresh: tokio::sync::Mutex::new(()),
        }
    }

    /// Records that `seq` exists (a projector has seen it).
    pub fn observe(&self, seq: u64) {
        self.known.fetch_max(seq, Ordering::Relaxed);
    }

    /// The stream's last sequence if `seq` is beyond it, `None` if `seq` exists (or existed:
    /// sequences are never reused).
    pub async fn beyond(&self, seq: u64) -> Result<Option<u64>, BusError> {
        if seq <= self.known.load(Ordering::Relaxed) {
            return Ok(None);
        }
        // A direct get of the first event at or after `seq`: found, `seq` exists (or did,
        // and was erased). Answered apart from the JetStream API's queue, where a
        // stream-info request waits under load; callers ask at once, not one at a time.
        if let Ok(Some(found)) = self
            .bus
            .direct_next_seq(engram_schema::STORED_SUBJECTS, seq)
            .await
        {
            self.observe(found);
            return Ok(None);
        }
        let _one_at_a_time = self.refresh.lock().await;
        if seq <= self.known.load(Ordering::Relaxed) {
            return Ok(None);
        }
        // Read after the caller's append was acknowledged, so its sequence is in here, as
        // the leader holds it.
        let mut last = self.leader_last_seq().await?;
        if seq > last && self.bus.replicas() > 1 {
            // On a cluster, a server that was cut off or frozen and has just come back may
            // answer from its stale copy before it learns of the new leader: an append
            // acknowledged meanwhile would look impossible. Asked again a moment later.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            last = last.max(self.leader_last_seq().await?);
        }
        self.observe(last);
        Ok((seq > last).then_some(last))
    }

    /// The events stream's last sequence from a server that knows the stream's leader; a
    /// replicated stream without one (an election) is `unavailable`, never an answer.
    async fn leader_last_seq(&self) -> Result<u64, BusError> {
        let stream = self.bus.events_stream().await?;
        let info = stream.cached_info();
        if self.bus.replicas() > 1
            && info
                .cluster
                .as_ref()
                .is_some_and(|c| c.leader.as_deref().unwrap_or_default().is_empty())
        {
            return Err(BusError::Unavailable(
                "the events stream is electing a leader; retry in a moment".into(),
            ));
        }
        Ok(info.state.last_sequence)
    }
}
