//! Replay pages (`engram.q.replay`, and through it `/v1/tail`): how an agent, whose key
//! reaches no stream, reads its scopes' events in stream order.
//!
//! A page costs the server no state: each scope is read with one batched direct get
//! ([`engram_bus::direct`]), never a consumer, so however many pages a caller asks for, no
//! other caller finds the stream's consumer limit used up. A page says how far it read
//! (`next_after`), found events or not, and a page that starts at the stream's end reads
//! nothing: an idle tail costs one stream-info request per poll and, when others wrote
//! since, one small direct get per scope, whatever they wrote.
//!
//! Concurrent pages are bounded per agent and per tenant ([`Shares`]), below the endpoint's
//! own `query.max_in_flight`, so one tenant's pages never take all of the endpoint.

use std::collections::HashMap;
use std::sync::Mutex;

use engram_bus::{Bus, ReadError};
use engram_memory::ScopeKey;
use engram_memory::proto::{self, ErrorCode};
use engram_rpc::Failure;
use engram_schema::Ident;
use engram_telemetry::metrics;

use crate::unavailable;

/// Replay pages one agent has in flight at once; one more is answered `busy` (429). A tail
/// reads one page at a time, so this is also how many tails of one key page at once.
pub const MAX_REPLAYS_PER_AGENT: usize = 4;

/// Replay pages one tenant's agents have in flight at once, together; one more is answered
/// `busy` (429). A quarter of the endpoint's default `query.max_in_flight` (64), so no
/// tenant can hold the endpoint alone.
pub const MAX_REPLAYS_PER_TENANT: usize = 16;

/// Who holds replay pages in flight.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Holder {
    Tenant(Ident),
    Agent(Ident, Ident),
}

/// Replay pages in flight by agent and by tenant, each bounded.
#[derive(Debug)]
pub struct Shares {
    per_agent: usize,
    per_tenant: usize,
    /// Pages in flight by holder; a holder with none has no entry, so the map holds at
    /// most one entry per page in flight (and its tenant's).
    held: Mutex<HashMap<Holder, usize>>,
}

impl Default for Shares {
    fn default() -> Self {
        Self::new(MAX_REPLAYS_PER_AGENT, MAX_REPLAYS_PER_TENANT)
    }
}

impl Shares {
    pub fn new(per_agent: usize, per_tenant: usize) -> Self {
        Self {
            per_agent: per_agent.max(1),
            per_tenant: per_tenant.max(1),
            held: Mutex::default(),
        }
    }

    /// A share for one page of `tenant` (and of `agent`, when an agent asks), held until
    /// dropped; `busy` naming the limit when the tenant or the agent holds all of its own.
    pub fn take(&self, tenant: &Ident, agent: Option<&Ident>) -> Result<Share<'_>, Failure> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let of_tenant = Holder::Tenant(tenant.clone());
        let in_tenant = held.get(&of_tenant).copied().unwrap_or(0);
        if in_tenant >= self.per_tenant {
            return Err(Failure::new(
                ErrorCode::Busy,
                format!(
                    "tenant {tenant} has {in_tenant} replay pages in flight, its whole share (query replay share per tenant: {}); retry when one has been answered",
                    self.per_tenant
                ),
            ));
        }
        let of_agent = agent.map(|a| Holder::Agent(tenant.clone(), a.clone()));
        if let Some(holder) = &of_agent {
            let mine = held.get(holder).copied().unwrap_or(0);
            if mine >= self.per_agent {
                return Err(Failure::new(
                    ErrorCode::Busy,
                    format!(
                        "agent {} of tenant {tenant} has {mine} replay pages in flight, its whole share (query replay share per agent: {}); page one at a time, or retry when one has been answered",
                        agent.map(Ident::as_str).unwrap_or_default(),
                        self.per_agent
                    ),
                ));
            }
        }
        let holders: Vec<Holder> = std::iter::once(of_tenant).chain(of_agent).collect();
        for holder in &holders {
            *held.entry(holder.clone()).or_default() += 1;
        }
        Ok(Share {
            shares: self,
            holders,
        })
    }

    #[cfg(test)]
    fn entries(&self) -> usize {
        self.held.lock().unwrap().len()
    }
}

/// One page's share; dropping it gives it back.
#[derive(Debug)]
pub struct Share<'a> {
    shares: &'a Shares,
    holders: Vec<Holder>,
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        let mut held = self.shares.held.lock().unwrap_or_else(|p| p.into_inner());
        for holder in &self.holders {
            if let Some(n) = held.get_mut(holder) {
                *n -= 1;
                if *n == 0 {
                    held.remove(holder);
                }
            }
        }
    }
}

/// One page of `keys`' events after `after_seq`, at most `limit` of them. Each scope is read
/// with one direct-get batch of at most a page; the page ends where the first scope's batch
/// was cut short, so no page skips an event of another scope, and where every batch was
/// read out, at the stream's last sequence.
pub(crate) async fn page(
    bus: &Bus,
    keys: &[ScopeKey],
    after_seq: u64,
    limit: usize,
) -> Result<proto::ReplayResponse, Failure> {
    let max_bytes = proto::limits::MAX_REPLAY_BYTES;
    let position = bus.stream_position().await.map_err(unavailable)?;
    let last_seq = position.last_seq;
    // How far every scope has been read: the page covers the stream up to here.
    let mut covered = last_seq.max(after_seq);
    let mut merged = Vec::new();
    if last_seq <= after_seq {
        // Nothing was appended anywhere since the page's start: nothing to ask.
        metrics::REPLAY_SCOPE_READS
            .with_label_values(&["skipped"])
            .inc_by(keys.len() as u64);
    }
    for key in keys.iter().filter(|_| last_seq > after_seq) {
        let filter = engram_schema::SubjectFilter::all()
            .tenant(key.tenant.clone())
            .scope(key.kind, key.id.clone())
            .to_subject();
        let batch = bus
            .direct_batch(&filter, after_seq + 1, limit, max_bytes)
            .await
            .map_err(unavailable)?;
        let mut found = 0usize;
        for item in batch.items {
            match item {
                // Appended after the page's view of the stream: the next page's.
                Ok(stored) if stored.seq > last_seq => break,
                Ok(stored) => {
                    found += 1;
                    merged.push(proto::ReplayedEvent {
                        seq: stored.seq,
                        stored_at: stored.stored_at,
                        event: stored.event,
                    });
                }
                // Not an event of this scope (it does not decode, or its body names
                // another): the projectors skip it too.
                Err(ReadError::Decode { .. }) => continue,
                Err(e) => return Err(unavailable(e)),
            }
        }
        metrics::REPLAY_SCOPE_READS
            .with_label_values(&[if found > 0 { "events" } else { "empty" }])
            .inc();
        let scope_covered = if batch.last_seq > last_seq {
            // The batch went past the page's end: every event of the scope up to it is in.
            last_seq
        } else if batch.pending > 0 {
            // Cut short by the batch's count or bytes.
            batch.last_seq.max(after_seq)
        } else if position.replicas > 1 {
            // Read out, as far as the answering server knew; a replica may lag the leader
            // that reported `last_seq`, so the leader says whether more is due.
            let from = batch.last_seq.max(after_seq) + 1;
            match bus
                .leader_next_seq(&filter, from)
                .await
                .map_err(unavailable)?
            {
                Some(next) if next <= last_seq => next - 1,
                _ => last_seq,
            }
        } else {
            last_seq
        };
        covered = covered.min(scope_covered);
    }
    Ok(assemble(
        merged,
        position.first_seq,
        last_seq,
        after_seq,
        covered,
        limit,
        max_bytes,
    ))
}

/// The page from the scopes' events: in stream order, up to `covered`, then at most
/// `limit` events and about `max_bytes` of JSON (a page always holds its first event).
fn assemble(
    mut merged: Vec<proto::ReplayedEvent>,
    first_seq: u64,
    last_seq: u64,
    after_seq: u64,
    covered: u64,
    limit: usize,
    max_bytes: usize,
) -> proto::ReplayResponse {
    let size = |e: &proto::ReplayedEvent| serde_json::to_vec(e).map_or(0, |b| b.len());
    merged.sort_by_key(|e| e.seq);
    merged.retain(|e| e.seq <= covered);
    let mut events = Vec::with_capacity(merged.len().min(limit));
    let (mut bytes, mut trimmed) = (0, false);
    for e in merged {
        if events.len() >= limit || (bytes >= max_bytes && !events.is_empty()) {
            trimmed = true;
            break;
        }
        bytes += size(&e);
        events.push(e);
    }
    let next_after = if trimmed {
        events
            .last()
            .map_or(after_seq, |e: &proto::ReplayedEvent| e.seq)
    } else {
        covered
    };
    proto::ReplayResponse {
        events,
        first_seq,
        last_seq,
        next_after,
        done: !trimmed && covered >= last_seq,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(s: &str) -> Ident {
        Ident::parse("test", s).unwrap()
    }

    #[test]
    fn an_agent_beyond_its_share_is_busy_while_another_tenant_is_served() {
        let shares = Shares::new(2, 3);
        let (acme, acme2) = (ident("acme"), ident("acme2"));
        let (planner, coder) = (ident("planner"), ident("coder"));
        let first = shares.take(&acme, Some(&planner)).unwrap();
        let second = shares.take(&acme, Some(&planner)).unwrap();
        let busy = shares.take(&acme, Some(&planner)).unwrap_err();
        assert_eq!(busy.code, ErrorCode::Busy);
        assert!(
            busy.message.contains("agent planner") && busy.message.contains("per agent: 2"),
            "{}",
            busy.message
        );
        // Another tenant's agent of the same name, and another agent of the same tenant.
        let other_tenant = shares.take(&acme2, Some(&planner)).unwrap();
        let same_tenant = shares.take(&acme, Some(&coder)).unwrap();
        // The tenant's share is full now (3): its other agents wait too, acme2's do not.
        let busy = shares.take(&acme, Some(&ident("reviewer"))).unwrap_err();
        assert!(
            busy.message.contains("tenant acme ") && busy.message.contains("per tenant: 3"),
            "{}",
            busy.message
        );
        let admin_of_full_tenant = shares.take(&acme, None).unwrap_err();
        assert_eq!(admin_of_full_tenant.code, ErrorCode::Busy);
        let more_of_acme2 = shares.take(&acme2, Some(&coder)).unwrap();
        // Given back on drop, entries removed with the last page.
        drop((first, second));
        let again = shares.take(&acme, Some(&planner)).unwrap();
        drop((again, other_tenant, same_tenant, more_of_acme2));
        assert_eq!(shares.entries(), 0);
    }

    #[test]
    fn the_default_shares_fit_within_the_endpoint() {
        let endpoint = crate::QueryConfig::default().max_in_flight;
        const _: () = assert!(MAX_REPLAYS_PER_AGENT <= MAX_REPLAYS_PER_TENANT);
        assert!(MAX_REPLAYS_PER_TENANT < endpoint);
    }

    fn event(seq: u64) -> proto::ReplayedEvent {
        proto::ReplayedEvent {
            seq,
            stored_at: chrono::Utc::now(),
            event: engram_schema::Envelope::new(
                ident("acme"),
                "task:t1".parse().unwrap(),
                ident("planner"),
                ident("i-1"),
                engram_schema::Layer::Episodic,
                engram_schema::EventKind::Observation,
                engram_schema::Content::text("x"),
            ),
        }
    }

    #[test]
    fn a_page_that_found_nothing_covers_the_stream_up_to_its_end() {
        let page = assemble(Vec::new(), 1, 90, 10, 90, 500, 1 << 20);
        assert_eq!((page.next_after, page.done), (90, true));
        assert!(page.events.is_empty());
    }

    #[test]
    fn a_page_ends_where_a_scope_was_cut_short_and_at_the_limit() {
        // Scope a read out to 90; scope b cut at 40: the page ends at 40, merged in order.
        let merged = vec![event(30), event(50), event(20), event(40)];
        let page = assemble(merged, 1, 90, 10, 40, 500, 1 << 20);
        let seqs: Vec<u64> = page.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [20, 30, 40]);
        assert_eq!((page.next_after, page.done), (40, false));
        // Then the limit: two events, ending at the second.
        let merged = vec![event(30), event(20), event(40)];
        let page = assemble(merged, 1, 90, 10, 90, 2, 1 << 20);
        assert_eq!(
            (page.events.len(), page.next_after, page.done),
            (2, 30, false)
        );
    }
}
