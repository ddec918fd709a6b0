//! Routing to the read models' partitions. Every partition of the events stream has its own
//! instance of each read model (`engram.p.<model>.<op>.<partition>`), served by the memory
//! node that owns it. A request over several scopes (its own plus grants) goes to the
//! partitions holding them, all at once, each within its own deadline inside the caller's,
//! and the answers are merged into what one model holding everything would give.
//!
//! At most one request per partition and model: a fan-out is bounded by the scopes a
//! request may name, and never exceeds the number of partitions.

use std::time::Duration;

use engram_memory::proto::{self, ErrorCode, MemoryHit, SearchResponse};
use engram_memory::{Hit, ScopeKey, Seq};
use engram_rpc::Failure;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Query;

impl Query {
    /// The events stream's partitions, as this deployment provisioned them.
    pub(crate) fn partitions(&self) -> u32 {
        self.bus.config().stream.partitions
    }

    /// The partitions holding `scopes`, each with its scopes, in partition order.
    pub(crate) fn split(&self, scopes: &[ScopeKey]) -> Vec<(u32, Vec<ScopeKey>)> {
        proto::by_partition(scopes, self.partitions())
    }

    /// Asks `op` of `model` on each of `partitions` at once, every request with `timeout`;
    /// the answers in the same order. A partition hosted in this process is asked in
    /// process ([`engram_rpc::LocalRoutes`]), any other over NATS. The first failure is the
    /// answer: a partition no node serves is `unavailable` at once (no responders), never
    /// a wait.
    pub(crate) async fn ask<Req, Resp>(
        &self,
        model: &str,
        op: &str,
        partitions: impl IntoIterator<Item = (u32, Req)>,
        timeout: Duration,
    ) -> Result<Vec<Resp>, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        let asks = partitions.into_iter().map(|(p, request)| {
            let subject = proto::partition_subject(model, op, p);
            async move {
                if let Some(route) = self.local.get().and_then(|l| l.route(&subject)) {
                    return route.call::<Req, Resp>(request, timeout).await;
                }
                engram_rpc::call(&self.client, &subject, &request, timeout)
                    .await
                    .map_err(|e| match e {
                        engram_rpc::RpcError::NoResponders { .. } => Failure::new(
                            ErrorCode::Unavailable,
                            format!(
                                "no memory node serves partition {p} of the {model} model now; retry once one owns it"
                            ),
                        ),
                        e => Failure::from(e),
                    })
            }
        });
        futures::future::join_all(asks).await.into_iter().collect()
    }
}

/// Merges partitions' search answers: the `k` best hits by score (ties to the lower
/// sequence, as each index breaks them), every `also` score, and the least visible sequence.
pub(crate) fn merge_search(parts: Vec<SearchResponse>, k: usize) -> SearchResponse {
    let visible_seq = parts.iter().map(|p| p.visible_seq).min().unwrap_or(0);
    let mut hits: Vec<MemoryHit> = Vec::new();
    let mut also: Vec<Hit> = Vec::new();
    for part in parts {
        hits.extend(part.hits);
        also.extend(part.also);
    }
    hits.sort_by(|a, b| {
        b.hit
            .score
            .total_cmp(&a.hit.score)
            .then(a.hit.seq.cmp(&b.hit.seq))
    });
    hits.truncate(k);
    also.sort_by_key(|h| h.seq);
    also.dedup_by_key(|h| h.seq);
    SearchResponse {
        hits,
        also,
        visible_seq,
    }
}

/// Orders items answered by several partitions as one model lists them: by their scope's
/// place among the request's scopes (own first, then the grants), each partition's own
/// order kept within a scope; then keeps `limit`.
pub(crate) fn in_scope_order<T>(
    items: Vec<T>,
    scope_of: impl Fn(&T) -> Option<usize>,
    limit: usize,
) -> Vec<T> {
    let mut keyed: Vec<(usize, T)> = items
        .into_iter()
        .map(|item| (scope_of(&item).unwrap_or(usize::MAX), item))
        .collect();
    keyed.sort_by_key(|(place, _)| *place);
    keyed
        .into_iter()
        .map(|(_, item)| item)
        .take(limit)
        .collect()
}

/// Where a JSON item's `scope` (a [`ScopeKey`] as facts and skills carry it) is among
/// `scopes`.
pub(crate) fn scope_place(scopes: &[ScopeKey], item: &serde_json::Value) -> Option<usize> {
    let key: ScopeKey = serde_json::from_value(item.get("scope")?.clone()).ok()?;
    scopes.iter().position(|s| *s == key)
}

/// The least of partitions' visible sequences.
pub(crate) fn least_visible(seqs: impl IntoIterator<Item = Seq>) -> Seq {
    seqs.into_iter().min().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(seq: Seq, score: f32) -> MemoryHit {
        crate::fusion::tests::hit(seq, score, 0.5)
    }

    #[test]
    fn merged_hits_are_the_best_of_all_partitions_ties_to_the_lower_seq() {
        let a = SearchResponse {
            hits: vec![hit(1, 0.9), hit(7, 0.5)],
            also: vec![Hit { seq: 3, score: 0.1 }],
            visible_seq: 10,
        };
        let b = SearchResponse {
            hits: vec![hit(4, 0.7), hit(2, 0.5)],
            also: vec![Hit { seq: 3, score: 0.1 }],
            visible_seq: 8,
        };
        let merged = merge_search(vec![a, b], 3);
        let seqs: Vec<Seq> = merged.hits.iter().map(|h| h.hit.seq).collect();
        assert_eq!(seqs, [1, 4, 2]);
        assert_eq!(merged.also.len(), 1);
        assert_eq!(merged.visible_seq, 8);
    }
}
