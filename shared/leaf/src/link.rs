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
//! The hub's beat also carries what the leaf may read now (its scopes and the tenant's
//! grants to every agent, from the registry): a grant added or revoked after `engram leaf
//! add` changes the leaf's inbox sources within seconds, without new credentials. Only the
//! hub may publish on the leaf's down prefix, and a source beyond the leaf's permissions
//! could not create its consumer on the hub anyway.
//!
//! Each resume rewrites a stream's configuration twice, so a link that flaps (or a hostile
//! leaf that beats in bursts) must not make a side do it at will: a side resumes the same
//! sources at most once per [`MIN_RESUME_INTERVAL`]; a link back sooner is resumed when
//! the interval has passed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use engram_access::ScopePattern;
use engram_access::leaf::{
    LeafCredentials, LeafSpec, api_prefix, down_prefix, normalize, up_prefix,
};
use engram_schema::Ident;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
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

/// Largest beat payload a leaf reads, and most scopes in it.
pub const MAX_BEAT_BYTES: usize = 64 * 1024;
pub const MAX_BEAT_READS: usize = 1024;

/// Connects the leaf's server to the hub anew (a new leaf connection), so that the hub's
/// current permissions for it apply on its side too.
pub type Reconnect = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>
        + Send
        + Sync,
>;

/// Closes every leaf connection of the hub's server(s), so that each leaf connects again
/// under the permissions in force; returns how many were closed.
pub type Kick = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<usize, String>> + Send>>
        + Send
        + Sync,
>;

/// Whether what a leaf may do changed between two readings of the registry: a leaf
/// revoked, or its reads or writes changed. A leaf added is not a change (it connects
/// under its permissions).
pub fn permissions_changed(before: &[LeafSpec], now: &[LeafSpec]) -> bool {
    before
        .iter()
        .any(|old| now.iter().find(|l| l.name == old.name) != Some(old))
}

/// What the hub's beat to a leaf says.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DownBeat {
    /// Every scope the leaf may read now.
    pub reads: Vec<ScopePattern>,
}

impl DownBeat {
    /// The beat's reads, if it carries a usable list: an empty payload (an older hub), an
    /// oversized or malformed one, or an empty list leaves the inbox as it is.
    pub fn parse(payload: &[u8]) -> Option<Vec<ScopePattern>> {
        if payload.is_empty() || payload.len() > MAX_BEAT_BYTES {
            return None;
        }
        let beat: DownBeat = serde_json::from_slice(payload).ok()?;
        (!beat.reads.is_empty() && beat.reads.len() <= MAX_BEAT_READS)
            .then(|| normalize(beat.reads))
    }
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
/// the streams that source the hub (the inbox, the artifacts bucket) when they come back
/// after a silence. Brings the inbox's sources up to date when a beat says the leaf may
/// read other scopes than `creds` says. Also keeps `engram_leaf_link_up`.
pub fn spawn_leaf(
    client: async_nats::Client,
    js: jetstream::Context,
    mut creds: LeafCredentials,
    retention: crate::local::Retention,
    reconnect: Option<Reconnect>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let leaf = creds.leaf.clone();
    creds.reads = normalize(creds.reads);
    let mut streams = crate::local::hub_sourced_streams(&creds);
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
                    let Some(beat) = beat else { return };
                    if let Some(reads) = DownBeat::parse(&beat.payload)
                        && reads != creds.reads
                    {
                        let updated = LeafCredentials { reads, ..creds.clone() };
                        match crate::local::provision(&js, &updated, &retention).await {
                            Ok(()) => {
                                // Wider reads need the hub's permissions of a new
                                // connection (narrower ones the hub enforces at once).
                                let wider = updated.reads.iter().any(|r| !creds.reads.contains(r));
                                if wider && let Some(reconnect) = &reconnect {
                                    match reconnect().await {
                                        Ok(()) => {
                                            tracing::info!("reconnected to the hub for the scopes this leaf may read now");
                                            // The new sources failed over the old
                                            // connection: start them again now.
                                            resumes.back("hub", "leaf");
                                        }
                                        Err(e) => tracing::warn!(error = %e, "cannot reconnect to the hub; the scopes this leaf may read now arrive after its next reconnection"),
                                    }
                                }
                                tracing::info!(
                                    reads = %updated.reads.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                                    was = %creds.reads.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                                    "the hub changed what this leaf may read; inbox sources updated"
                                );
                                creds = updated;
                                streams = crate::local::hub_sourced_streams(&creds);
                            }
                            Err(e) => tracing::warn!(error = %e, "the hub changed what this leaf may read, but the inbox could not follow; trying again at the next beat"),
                        }
                    }
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
                    Ok(n) => {
                        tracing::info!(stream = %stream, sources = n, "link to the hub is up; sources resumed")
                    }
                    Err(e) => {
                        tracing::warn!(stream = %stream, error = %e, "link to the hub is up, but resuming the sources failed; they resume on the server's schedule")
                    }
                }
            }
        }
    })
}

/// The hub's side: beats down to every live leaf, listens for their beats, and resumes a
/// leaf's sources on the events stream when its beats come back after a silence. `leaves`
/// gives the live leaves (read again every few seconds; `None` when the registry could not
/// be read). When what a leaf may do changes, `kick` closes the leaf connections: the
/// server fixed their permissions when they connected, and re-checks them only then.
pub fn spawn_hub<F, Fut>(
    client: async_nats::Client,
    js: jetstream::Context,
    events_stream: String,
    leaves: F,
    kick: Option<Kick>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Option<Vec<LeafSpec>>> + Send,
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
                        refreshed = Some(Instant::now());
                        let Some(fresh) = leaves().await else { continue };
                        if permissions_changed(&known, &fresh) {
                            match &kick {
                                Some(kick) => match kick().await {
                                    Ok(n) => {
                                        engram_telemetry::metrics::LEAF_CONNECTIONS_CLOSED
                                            .with_label_values(&["ok"])
                                            .inc_by(n as u64);
                                        tracing::info!(closed = n, "what a leaf may do changed; its connections were closed so that they connect again under the permissions in force");
                                    }
                                    Err(e) => {
                                        engram_telemetry::metrics::LEAF_CONNECTIONS_CLOSED
                                            .with_label_values(&["failed"])
                                            .inc();
                                        tracing::error!(error = %e, "what a leaf may do changed, but its connection could not be closed: it keeps its old permissions until it connects again");
                                    }
                                },
                                None => tracing::warn!("what a leaf may do changed; a leaf connected now keeps its old permissions until it connects again (the server is not engram's, so engram cannot close its leaf connections)"),
                            }
                        }
                        known = fresh;
                        let is_known = |n: &str| known.iter().any(|l| l.name.as_str() == n);
                        last.retain(|n, _| is_known(n));
                        resumes.retain(is_known);
                    }
                    for leaf in &known {
                        let beat = serde_json::to_vec(&DownBeat { reads: leaf.reads.clone() })
                            .unwrap_or_default();
                        let _ = client.publish(beat_down(&leaf.name), beat.into()).await;
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
                let mut cycled = cycle_sources(&js, &events_stream, mine).await;
                if let (Ok(n), Ok(leaf)) = (&cycled, Ident::parse("leaf", &name)) {
                    let artifacts = engram_access::leaf::leaf_artifacts_stream(&leaf);
                    if js.get_stream(&artifacts).await.is_ok() {
                        let n = *n;
                        cycled = cycle_sources(&js, &artifacts, |_| true)
                            .await
                            .map(|m| n + m);
                    }
                }
                count_resume("hub", cycled.is_ok());
                match cycled {
                    Ok(n) => {
                        tracing::info!(leaf = %name, sources = n, "leaf link is up; its sources resumed")
                    }
                    Err(e) => {
                        tracing::warn!(leaf = %name, error = %e, "leaf link is up, but resuming its sources failed; they resume on the server's schedule")
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revoked_or_changed_leaf_is_a_change_and_a_new_one_is_not() {
        let spec = |name: &str, reads: &[&str]| LeafSpec {
            name: Ident::parse("leaf", name).unwrap(),
            tenant: Ident::parse("tenant", "acme").unwrap(),
            writes: vec!["task:*".parse().unwrap()],
            reads: reads.iter().map(|r| r.parse().unwrap()).collect(),
        };
        let a = spec("a", &["task:*"]);
        let b = spec("b", &["task:*"]);
        assert!(!permissions_changed(&[], std::slice::from_ref(&a)));
        assert!(!permissions_changed(
            std::slice::from_ref(&a),
            &[a.clone(), b.clone()]
        ));
        assert!(!permissions_changed(
            &[a.clone(), b.clone()],
            &[b.clone(), a.clone()]
        ));
        assert!(permissions_changed(
            &[a.clone(), b.clone()],
            std::slice::from_ref(&b)
        ));
        assert!(permissions_changed(
            std::slice::from_ref(&a),
            &[spec("a", &["task:*", "team:x"])]
        ));
    }

    #[test]
    fn a_beat_carries_the_reads_and_a_bad_one_changes_nothing() {
        let reads: Vec<ScopePattern> = ["task:*", "team:platform"]
            .iter()
            .map(|p| p.parse().unwrap())
            .collect();
        let payload = serde_json::to_vec(&DownBeat {
            reads: reads.clone(),
        })
        .unwrap();
        assert_eq!(DownBeat::parse(&payload), Some(normalize(reads)));
        assert_eq!(DownBeat::parse(b""), None, "an older hub's beat");
        assert_eq!(DownBeat::parse(b"{\"reads\": []}"), None);
        assert_eq!(DownBeat::parse(b"{\"reads\": [\"nope\"]}"), None);
        assert_eq!(DownBeat::parse(&vec![b' '; MAX_BEAT_BYTES + 1]), None);
        let many = serde_json::to_vec(&DownBeat {
            reads: (0..=MAX_BEAT_READS)
                .map(|i| format!("task:t{i}").parse().unwrap())
                .collect(),
        })
        .unwrap();
        assert_eq!(DownBeat::parse(&many), None);
    }

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
