//! Knowing when the link is back, and resuming the sources at once.
//!
//! While the link is down, each side's sources keep failing to set up their consumer across
//! it, and nats-server backs off between attempts (up to two minutes). A source whose setup
//! request was lost with the link can also stay "in progress" until it times out. So after
//! an outage the data would wait for the next attempt, not for the link. Each side therefore
//! beats once a second on a subject the leaf's permissions already carry
//! (`engram.leaf.<leaf>.down.beat` from the hub, `engram.leaf.<leaf>.up.beat` from the leaf),
//! and the first beat heard after a silence means the link is back: that side takes the
//! sources across it out of its stream and puts them back. A source put back resumes after
//! the last message it delivered (the server finds it by its `Nats-Stream-Source` header),
//! and anything delivered twice in the race is dropped by its `Nats-Msg-Id`.
//!
//! Each resume rewrites a stream's configuration twice, so a link that flaps (or a hostile
//! leaf that beats in bursts) must not make a side do it at will: a side resumes the same
//! sources at most once per [`MIN_RESUME_INTERVAL`]; a link back sooner is resumed when
//! the interval has passed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use engram_access::leaf::{LeafSpec, api_prefix, down_prefix, up_prefix};
use engram_schema::Ident;
use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;

use crate::{LeafError, js_err};

/// How often each side beats.
pub const BEAT: Duration = Duration::from_secs(1);
/// A silence this long, then a beat: the link was down and is back.
pub const SILENCE: Duration = Duration::from_secs(3);
/// The least time between two resumes of the same sources.
pub const MIN_RESUME_INTERVAL: Duration = Duration::from_secs(10);

/// Which links are back and waiting for their resume, and when each was last resumed.
#[derive(Debug, Default)]
struct Resumes {
    done_at: HashMap<String, Instant>,
    pending: std::collections::BTreeSet<String>,
}

impl Resumes {
    /// `link` came back: resume it now if the floor allows, else when it does.
    fn back(&mut self, link: &str, side: &str) {
        if !self.pending.insert(link.to_owned()) {
            return;
        }
        if !self.allowed(link, Instant::now()) {
            engram_telemetry::metrics::LEAF_SOURCE_RESUMES
                .with_label_values(&[side, "deferred"])
                .inc();
        }
    }

    fn allowed(&self, link: &str, now: Instant) -> bool {
        self.done_at
            .get(link)
            .is_none_or(|t| now.duration_since(*t) >= MIN_RESUME_INTERVAL)
    }

    /// The links to resume now; each is marked resumed.
    fn due(&mut self) -> Vec<String> {
        let now = Instant::now();
        let due: Vec<String> = self
            .pending
            .iter()
            .filter(|l| self.allowed(l, now))
            .cloned()
            .collect();
        for link in &due {
            self.pending.remove(link);
            self.done_at.insert(link.clone(), now);
        }
        due
    }

    /// Forgets links no longer known (a revoked leaf).
    fn retain(&mut self, known: impl Fn(&str) -> bool) {
        self.done_at.retain(|l, _| known(l));
        self.pending.retain(|l| known(l));
    }
}

fn count_resume(side: &str, ok: bool) {
    engram_telemetry::metrics::LEAF_SOURCE_RESUMES
        .with_label_values(&[side, if ok { "ok" } else { "failed" }])
        .inc();
}

fn beat_down(leaf: &Ident) -> String {
    format!("{}.beat", down_prefix(leaf))
}

fn beat_up(leaf: &Ident) -> String {
    format!("{}.beat", up_prefix(leaf))
}

/// Takes `sources` of `stream` (those `mine` selects) out and puts them back.
async fn cycle_sources(
    js: &jetstream::Context,
    stream: &str,
    mine: impl Fn(&jetstream::stream::Source) -> bool,
) -> Result<usize, LeafError> {
    let mut s = js.get_stream(stream).await.map_err(js_err)?;
    let config = s.info().await.map_err(js_err)?.config.clone();
    let sources = config.sources.clone().unwrap_or_default();
    let (cycled, kept): (Vec<_>, Vec<_>) = sources.iter().cloned().partition(|s| mine(s));
    if cycled.is_empty() {
        return Ok(0);
    }
    let without = jetstream::stream::Config {
        sources: (!kept.is_empty()).then_some(kept),
        ..config.clone()
    };
    js.update_stream(&without).await.map_err(js_err)?;
    js.update_stream(&config).await.map_err(js_err)?;
    Ok(cycled.len())
}

/// The leaf's side: beats up, listens for the hub's beats, and resumes the sources of
/// `streams` (the inbox, the artifacts bucket) when they come back after a silence. Also
/// keeps `engram_leaf_link_up`.
pub fn spawn_leaf(
    client: async_nats::Client,
    js: jetstream::Context,
    leaf: Ident,
    streams: Vec<String>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut beats = match client.subscribe(beat_down(&leaf)).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for the hub's beats; sources resume on the server's own schedule");
                return;
            }
        };
        let mut tick = tokio::time::interval(BEAT);
        let mut last: Option<Instant> = None;
        let mut resumes = Resumes::default();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {
                    let _ = client.publish(beat_up(&leaf), "".into()).await;
                    let up = last.is_some_and(|t| t.elapsed() < SILENCE);
                    engram_telemetry::metrics::LEAF_LINK_UP.set(i64::from(up));
                }
                beat = beats.next() => {
                    let Some(_) = beat else { return };
                    let back = last.is_none_or(|t| t.elapsed() >= SILENCE);
                    last = Some(Instant::now());
                    if back {
                        engram_telemetry::metrics::LEAF_LINK_UP.set(1);
                        resumes.back("hub", "leaf");
                    }
                }
            }
            if resumes.due().is_empty() {
                continue;
            }
            for stream in &streams {
                let cycled = cycle_sources(&js, stream, |_| true).await;
                count_resume("leaf", cycled.is_ok());
                match cycled {
                    Ok(n) => tracing::info!(stream = %stream, sources = n, "link to the hub is up; sources resumed"),
                    Err(e) => tracing::warn!(stream = %stream, error = %e, "link to the hub is up, but resuming the sources failed; they resume on the server's schedule"),
                }
            }
        }
    })
}

/// The hub's side: beats down to every live leaf, listens for their beats, and resumes a
/// leaf's sources on the events stream when its beats come back after a silence. `leaves`
/// gives the live leaves (read again every few seconds).
pub fn spawn_hub<F, Fut>(
    client: async_nats::Client,
    js: jetstream::Context,
    events_stream: String,
    leaves: F,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Vec<LeafSpec>> + Send,
{
    tokio::spawn(async move {
        let mut beats = match client.subscribe("engram.leaf.*.up.beat").await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for leaves' beats");
                return;
            }
        };
        let mut tick = tokio::time::interval(BEAT);
        let mut known: Vec<LeafSpec> = Vec::new();
        let mut refreshed: Option<Instant> = None;
        let mut last: HashMap<String, Instant> = HashMap::new();
        let mut resumes = Resumes::default();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {
                    if refreshed.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                        known = leaves().await;
                        refreshed = Some(Instant::now());
                        let is_known = |n: &str| known.iter().any(|l| l.name.as_str() == n);
                        last.retain(|n, _| is_known(n));
                        resumes.retain(is_known);
                    }
                    for leaf in &known {
                        let _ = client.publish(beat_down(&leaf.name), "".into()).await;
                    }
                }
                beat = beats.next() => {
                    let Some(beat) = beat else { return };
                    // engram.leaf.<leaf>.up.beat; a leaf may beat only on its own.
                    let Some(name) = beat.subject.as_str().split('.').nth(2) else { continue };
                    let Some(leaf) = known.iter().find(|l| l.name.as_str() == name) else { continue };
                    let back = last.get(name).is_none_or(|t| t.elapsed() >= SILENCE);
                    last.insert(name.to_owned(), Instant::now());
                    if back {
                        resumes.back(leaf.name.as_str(), "hub");
                    }
                }
            }
            for name in resumes.due() {
                let api = api_prefix(&name);
                let mine = |s: &jetstream::stream::Source| {
                    s.external.as_ref().is_some_and(|e| e.api_prefix == api)
                };
                let cycled = cycle_sources(&js, &events_stream, mine).await;
                count_resume("hub", cycled.is_ok());
                match cycled {
                    Ok(n) => tracing::info!(leaf = %name, sources = n, "leaf link is up; its sources resumed"),
                    Err(e) => tracing::warn!(leaf = %name, error = %e, "leaf link is up, but resuming its sources failed; they resume on the server's schedule"),
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_back_is_resumed_at_once_then_not_again_within_the_floor() {
        let mut r = Resumes::default();
        r.back("laptop", "hub");
        assert_eq!(r.due(), ["laptop"]);
        assert!(r.due().is_empty(), "resumed twice for one return");
        // Back again at once (a flap): deferred, not dropped.
        r.back("laptop", "hub");
        r.back("laptop", "hub");
        assert!(r.due().is_empty(), "resumed again within the floor");
        assert_eq!(r.pending.len(), 1);
        // Once the floor has passed, it is resumed once.
        let earlier = Instant::now() - MIN_RESUME_INTERVAL;
        r.done_at.insert("laptop".into(), earlier);
        assert_eq!(r.due(), ["laptop"]);
        assert!(r.due().is_empty());
        // Another link is not held back by this one's floor.
        r.back("desk", "hub");
        assert_eq!(r.due(), ["desk"]);
        // A revoked leaf is forgotten.
        r.back("desk", "hub");
        r.retain(|n| n == "laptop");
        assert!(r.pending.is_empty() && !r.done_at.contains_key("desk"));
    }
}
