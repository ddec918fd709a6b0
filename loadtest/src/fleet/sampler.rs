//! Once a second: how far behind each projector is, and what the local processes use.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engram_bus::Bus;
use engram_memory::proto::{Consistency, partition_subject};
use engram_projectors::ProjectorLedger;
use tokio::sync::watch;
use tokio::time::Instant;

use super::target::projectors;

/// Asks a projector for its apply ledger (cheap: no state hash): every partition's, merged
/// ([`ProjectorLedger::merge`]). The load test provisions its deployments with the default
/// partitions.
pub(crate) async fn projector_ledger(
    client: &async_nats::Client,
    name: &str,
) -> Result<ProjectorLedger, engram_rpc::RpcError> {
    let asks = (0..engram_schema::DEFAULT_PARTITIONS).map(|p| {
        let subject = partition_subject(name, "ledger", p);
        async move {
            engram_rpc::call::<_, ProjectorLedger>(
                client,
                &subject,
                &Consistency::default(),
                Duration::from_secs(2),
            )
            .await
        }
    });
    let parts = futures::future::join_all(asks)
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ProjectorLedger::merge(name, &parts))
}

/// One second's reading.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sample {
    pub(crate) at_secs: f64,
    pub(crate) last_seq: Option<u64>,
    /// Per projector, its visible sequence (`None`: it did not answer).
    pub(crate) visible: BTreeMap<String, Option<u64>>,
    /// Per process: (CPU percent of one core over the last second, RSS MiB).
    pub(crate) processes: BTreeMap<String, (Option<f64>, Option<f64>)>,
}

impl Sample {
    pub(crate) fn lag(&self, projector: &str) -> Option<u64> {
        let visible = (*self.visible.get(projector)?)?;
        Some(self.last_seq?.saturating_sub(visible))
    }
}

/// The samples so far, shared with whoever wants the latest (chaos, drain, progress).
#[derive(Clone, Default)]
pub(crate) struct Samples(Arc<Mutex<Vec<Sample>>>);

impl Samples {
    pub(crate) fn all(&self) -> Vec<Sample> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn last(&self) -> Option<Sample> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .last()
            .cloned()
    }

    fn push(&self, sample: Sample) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(sample);
    }
}

/// Samples every second until `stop` turns true. `pids` is re-read each time, so a restarted
/// process is followed under its new pid.
pub(crate) async fn run(
    bus: Bus,
    started: Instant,
    pids: Arc<Mutex<Vec<(String, u32)>>>,
    samples: Samples,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut previous_cpu: BTreeMap<String, (u32, Duration, Instant)> = BTreeMap::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let at = Instant::now();
        let mut sample = Sample {
            at_secs: (at - started).as_secs_f64(),
            ..Sample::default()
        };
        // A dead server answers nothing; bound each probe so the tick stays near a second.
        sample.last_seq = tokio::time::timeout(Duration::from_millis(800), bus.stream_state())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|s| s.last_seq);
        let ledgers = futures::future::join_all(
            projectors()
                .into_iter()
                .map(|name| projector_ledger(bus.client(), name)),
        )
        .await;
        for (name, ledger) in projectors().into_iter().zip(ledgers) {
            sample
                .visible
                .insert((*name).to_owned(), ledger.ok().map(|l| l.visible_seq));
        }
        let current = pids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for (name, pid) in current {
            let cpu = crate::cpu::of_pid(pid);
            let percent = match (cpu, previous_cpu.get(&name)) {
                (Some(now), Some(&(prev_pid, before, when))) if prev_pid == pid => {
                    let wall = (at - when).as_secs_f64();
                    (wall > 0.0).then(|| now.saturating_sub(before).as_secs_f64() / wall * 100.0)
                }
                _ => None,
            };
            if let Some(now) = cpu {
                previous_cpu.insert(name.clone(), (pid, now, at));
            }
            sample.processes.insert(name, (percent, rss_mib(pid)));
        }
        samples.push(sample);
    }
}

/// Resident memory of a process in MiB, from `/proc/<pid>/status`.
pub(crate) fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_own_rss() {
        let rss = super::rss_mib(std::process::id()).unwrap();
        assert!(rss > 0.1, "{rss}");
        assert!(super::rss_mib(u32::MAX).is_none());
    }
}
