//! Retrieval usage: how often each memory was returned, written to the log as one
//! `feedback` event per scope per `query.usage_interval`, never one write per query.
//!
//! The `retrieve` and `context` endpoints count what they return ([`Usage::count`]: one per
//! memory per response, under the memory's own scope). [`Usage::run`] takes the counts every
//! interval, or at once when [`MAX_DISTINCT`] distinct memories are held, and appends per
//! scope `feedback {"retrieved": {"<event id>": n}}` events of at most [`MAX_RETRIEVED`] ids.
//! It flushes once more when stopped. The events are written as agent [`AGENT`], instance
//! `query.instance_id`, episodic like an agent's use report, with empty text: no read model
//! takes them for a memory (`is_text_memory`), so they never come back in retrieval.
//!
//! An event id derives from (instance, run, scope, flush number, part). An event the
//! stream did not acknowledge is kept, and appended again by the same id on the next
//! flush, so the stream stores it once. The run is a fresh id per start: a restarted
//! service never reuses its predecessor's ids inside the stream's duplicate window (which
//! would drop its reports as duplicates).
//!
//! A query never waits on an append here: counting takes a short lock, appending happens on
//! the flusher task.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use engram_bus::Bus;
use engram_memory::ScopeKey;
use engram_schema::payload::MAX_RETRIEVED;
use engram_schema::{Content, Envelope, EventId, EventKind, Ident, Layer, Retrieved};
use engram_telemetry::metrics;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The agent id usage events are written as.
pub const AGENT: &str = "query";
/// Distinct memories (over all scopes) held before a flush is started early. Past twice
/// this (the flusher is stuck appending), returns of further memories are dropped, counted
/// in `engram_query_retrievals_counted_total{outcome="dropped"}`.
pub const MAX_DISTINCT: usize = 100_000;
/// Events waiting to be appended again (the stream was unavailable); past this the oldest
/// are dropped. Twice [`MAX_DISTINCT`] ids' worth.
pub const MAX_PENDING_EVENTS: usize = 2 * MAX_DISTINCT / MAX_RETRIEVED;

/// The query service's retrieval counts, shared by the endpoints and the flusher.
pub struct Usage {
    /// False when `usage_interval` is 0: nothing is counted.
    enabled: bool,
    agent: Ident,
    instance: Ident,
    /// Fresh per start; part of every event id.
    run: String,
    counts: Mutex<Counts>,
    /// Wakes the flusher when [`MAX_DISTINCT`] is reached.
    full: Notify,
}

/// Returns since the last flush, by scope and memory.
#[derive(Debug, Default)]
struct Counts {
    scopes: HashMap<ScopeKey, HashMap<EventId, u32>>,
    /// Distinct (scope, memory) pairs in `scopes`.
    distinct: usize,
}

impl Usage {
    pub fn new(instance: Ident, enabled: bool) -> Self {
        Self {
            enabled,
            agent: Ident::parse("agent_id", AGENT).expect("a valid ident"),
            instance,
            run: EventId::new().to_string(),
            counts: Mutex::new(Counts::default()),
            full: Notify::new(),
        }
    }

    /// Counts one return of each memory, under the memory's own scope.
    pub fn count<'a>(&self, returned: impl IntoIterator<Item = (ScopeKey, &'a EventId)>) {
        if !self.enabled {
            return;
        }
        let (mut counted, mut dropped) = (0u64, 0u64);
        let reached = {
            let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
            let Counts { scopes, distinct } = &mut *counts;
            for (scope, id) in returned {
                let ids = scopes.entry(scope).or_default();
                if let Some(n) = ids.get_mut(id) {
                    *n = n.saturating_add(1);
                } else if *distinct < 2 * MAX_DISTINCT {
                    ids.insert(id.clone(), 1);
                    *distinct += 1;
                } else {
                    dropped += 1;
                    continue;
                }
                counted += 1;
            }
            *distinct >= MAX_DISTINCT
        };
        metrics::USAGE_RETRIEVALS
            .with_label_values(&["counted"])
            .inc_by(counted);
        if dropped > 0 {
            metrics::USAGE_RETRIEVALS
                .with_label_values(&["dropped"])
                .inc_by(dropped);
        }
        if reached {
            self.full.notify_one();
        }
    }

    fn take(&self) -> Counts {
        std::mem::take(&mut *self.counts.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The usage events of one flush: per scope (in key order), its memories in id order,
    /// [`MAX_RETRIEVED`] per event, stamped `at`.
    fn events(&self, counts: Counts, flush: u64, at: DateTime<Utc>) -> Vec<Envelope> {
        let mut scopes: Vec<(ScopeKey, HashMap<EventId, u32>)> =
            counts.scopes.into_iter().collect();
        scopes.sort_by(|a, b| a.0.cmp(&b.0));
        let flush = flush.to_string();
        let mut out = Vec::new();
        for (key, ids) in scopes {
            let ids: Vec<(EventId, u32)> = BTreeMap::from_iter(ids).into_iter().collect();
            let scope = key.scope();
            let scope_name = scope.to_string();
            for (part, chunk) in ids.chunks(MAX_RETRIEVED).enumerate() {
                let payload = Retrieved {
                    retrieved: chunk.iter().cloned().collect(),
                };
                let mut event = Envelope::new(
                    key.tenant.clone(),
                    scope.clone(),
                    self.agent.clone(),
                    self.instance.clone(),
                    Layer::Episodic,
                    EventKind::Feedback,
                    Content {
                        text: String::new(),
                        data: Some(
                            serde_json::to_value(&payload).expect("a map of ids serialises"),
                        ),
                    },
                );
                event.event_id = EventId::derived(&[
                    "retrieval-usage",
                    self.instance.as_str(),
                    &self.run,
                    key.tenant.as_str(),
                    &scope_name,
                    &flush,
                    &part.to_string(),
                ]);
                event.occurred_at = at;
                event.recorded_at = at;
                out.push(event);
            }
        }
        out
    }

    /// Flushes every `interval`, early when [`MAX_DISTINCT`] memories are held, and once
    /// more when `stop` is cancelled; then returns. Cancel `stop` only once the endpoints
    /// have stopped answering, so that nothing they count afterwards is lost.
    pub async fn run(self: Arc<Self>, bus: Bus, interval: Duration, stop: CancellationToken) {
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut pending: VecDeque<Envelope> = VecDeque::new();
        let mut flushes = 0u64;
        loop {
            let stopping = tokio::select! {
                _ = ticker.tick() => false,
                () = self.full.notified() => false,
                () = stop.cancelled() => true,
            };
            let counts = self.take();
            if counts.distinct > 0 {
                flushes += 1;
                pending.extend(self.events(counts, flushes, Utc::now()));
            }
            let over = pending.len().saturating_sub(MAX_PENDING_EVENTS);
            if over > 0 {
                pending.drain(..over);
                metrics::USAGE_EVENTS
                    .with_label_values(&["dropped"])
                    .inc_by(over as u64);
                tracing::warn!(
                    dropped = over,
                    "retrieval usage events dropped: the stream has not taken them"
                );
            }
            if !pending.is_empty() {
                pending = append(&bus, pending).await;
            }
            if stopping {
                if !pending.is_empty() {
                    tracing::warn!(
                        events = pending.len(),
                        "query service stopped with retrieval usage events not appended"
                    );
                }
                return;
            }
        }
    }
}

/// Appends `events`; returns those to try again (not acknowledged, retryable).
async fn append(bus: &Bus, events: VecDeque<Envelope>) -> VecDeque<Envelope> {
    let events = Vec::from(events);
    let results = bus.append_batch(&events, bus.config().max_inflight).await;
    let mut again = VecDeque::new();
    for (event, result) in events.into_iter().zip(results) {
        match result {
            Ok(_) => metrics::USAGE_EVENTS.with_label_values(&["appended"]).inc(),
            Err(e) if e.is_retryable() => {
                tracing::debug!(event_id = %event.event_id, error = %e, "retrieval usage event will be appended again");
                metrics::USAGE_EVENTS.with_label_values(&["retried"]).inc();
                again.push_back(event);
            }
            Err(e) => {
                tracing::error!(
                    event_id = %event.event_id,
                    tenant = %event.tenant,
                    scope = %event.scope,
                    error = %e,
                    "retrieval usage event refused"
                );
                metrics::USAGE_EVENTS.with_label_values(&["dropped"]).inc();
            }
        }
    }
    again
}

#[cfg(test)]
mod tests {
    use engram_schema::{Scope, ScopeKind};

    use super::*;

    fn key(tenant: &str, scope: &str) -> ScopeKey {
        ScopeKey::new(
            Ident::parse("tenant", tenant).unwrap(),
            Scope::new(ScopeKind::Team, scope).unwrap(),
        )
    }

    fn usage() -> Usage {
        Usage::new(Ident::parse("instance_id", "query-a").unwrap(), true)
    }

    #[test]
    fn returns_are_counted_per_scope_and_written_as_one_checked_event_per_scope() {
        let usage = usage();
        let (a, b) = (EventId::new(), EventId::new());
        for _ in 0..50 {
            usage.count([(key("acme", "core"), &a)]);
        }
        usage.count([(key("acme", "core"), &b), (key("acme", "ops"), &a)]);
        let counts = usage.take();
        assert_eq!(counts.distinct, 3);
        assert_eq!(usage.take().distinct, 0, "taking empties the counts");
        let events = usage.events(counts, 1, Utc::now());
        assert_eq!(events.len(), 2, "one per scope");
        for event in &events {
            event.validate().unwrap();
            assert!(!engram_memory::is_text_memory(event));
            assert_eq!(
                (event.agent_id.as_str(), event.instance_id.as_str()),
                (AGENT, "query-a")
            );
        }
        let core = Retrieved::from_event(&events[0]).unwrap().unwrap();
        assert_eq!(core.retrieved, BTreeMap::from([(a.clone(), 50), (b, 1)]));
        let ops = Retrieved::from_event(&events[1]).unwrap().unwrap();
        assert_eq!(ops.retrieved, BTreeMap::from([(a, 1)]));
    }

    #[test]
    fn a_flush_over_the_payload_bound_splits_and_ids_are_derived_not_random() {
        let usage = usage();
        let ids: Vec<EventId> = (0..MAX_RETRIEVED * 2 + 1).map(|_| EventId::new()).collect();
        let flush = |usage: &Usage, n: u64| {
            usage.count(ids.iter().map(|id| (key("acme", "core"), id)));
            usage.events(usage.take(), n, Utc::now())
        };
        let first = flush(&usage, 1);
        assert_eq!(first.len(), 3);
        let total: usize = first
            .iter()
            .map(|e| Retrieved::from_event(e).unwrap().unwrap().retrieved.len())
            .sum();
        assert_eq!(total, ids.len());
        // The same flush built again (a retry) has the same ids; another flush, another
        // run or another instance does not.
        let again = flush(&usage, 1);
        let event_ids = |events: &[Envelope]| -> Vec<EventId> {
            events.iter().map(|e| e.event_id.clone()).collect()
        };
        assert_eq!(event_ids(&first), event_ids(&again));
        assert_ne!(event_ids(&first), event_ids(&flush(&usage, 2)));
        assert_ne!(
            event_ids(&first),
            event_ids(&flush(&super::Usage::new(usage.instance.clone(), true), 1))
        );
    }

    #[test]
    fn disabled_usage_counts_nothing_and_the_bound_wakes_the_flusher() {
        let off = Usage::new(Ident::parse("instance_id", "q").unwrap(), false);
        off.count([(key("acme", "core"), &EventId::new())]);
        assert_eq!(off.take().distinct, 0);

        let usage = usage();
        let ids: Vec<EventId> = (0..MAX_DISTINCT).map(|_| EventId::new()).collect();
        usage.count(ids.iter().map(|id| (key("acme", "core"), id)));
        let woken = usage.full.notified();
        tokio::pin!(woken);
        // A stored permit completes the wait at once.
        assert!(futures::FutureExt::now_or_never(woken.as_mut()).is_some());
        // Past twice the bound, new memories are dropped; known ones still count.
        let more: Vec<EventId> = (0..MAX_DISTINCT + 1).map(|_| EventId::new()).collect();
        usage.count(more.iter().map(|id| (key("acme", "core"), id)));
        usage.count([(key("acme", "core"), &ids[0])]);
        let counts = usage.take();
        assert_eq!(counts.distinct, 2 * MAX_DISTINCT);
        assert_eq!(counts.scopes[&key("acme", "core")][&ids[0]], 2);
    }
}
