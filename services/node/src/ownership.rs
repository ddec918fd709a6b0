//! Who owns which partition: memory nodes' membership and partition leases, in one KV bucket
//! whose entries expire.
//!
//! - `member.<node>`: a node's liveness and the partitions it may own, rewritten every tick.
//!   A node that stops writing it (killed, frozen, cut off) drops out when it expires.
//! - `owner.p<partition>`: the partition's lease. Holding it means having written it last:
//!   `create` takes a free one, `update` at the revision last written renews it, and it
//!   expires one TTL after the holder's last renewal, when another node may take it.
//!
//! Every node computes the same assignment from the live members ([`assign`], rendezvous
//! hashing: each partition to the eligible member with the highest hash of the pair), so a
//! join or a leave moves only the partitions whose winner changed, about `1/n` of them. A
//! node takes the free partitions assigned to it, and hands over those assigned to another
//! live member; one assigned to a dead member waits for its lease to expire.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::kv;
use engram_bus::{Bus, BusError};
use engram_projectors::PartitionSet;
use serde::{Deserialize, Serialize};

/// A node as its membership entry says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub node: String,
    /// Names the node's state dir, so that a node restarted on it reclaims its own leases,
    /// and another process that borrows its name is told so.
    pub state: String,
    /// The partitions it may own (`projectors.partitions`).
    pub partitions: String,
    /// Where its `/healthz` and `/metrics` are, if it serves them.
    #[serde(default)]
    pub http: Option<String>,
    /// The partitions it answers now (held and caught up), ascending.
    #[serde(default)]
    pub serving: Vec<u32>,
}

impl Member {
    /// The partitions it may own; an entry that does not parse (a newer node's) may own
    /// none, rather than every one.
    pub fn eligible(&self) -> PartitionSet {
        self.partitions
            .parse()
            .unwrap_or_else(|_| PartitionSet::none())
    }
}

/// What a partition's lease holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub node: String,
    pub state: String,
}

/// The rendezvous hash of a partition and a node.
fn score(partition: u32, node: &str) -> u64 {
    let mut hash = blake3::Hasher::new();
    hash.update(&partition.to_le_bytes());
    hash.update(node.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.finalize().as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// Each partition's owner among `members` (node, partitions it may own); `None` where no
/// member may own it. Each partition goes to the eligible member with the highest [`score`]
/// (ties to the lower name) that does not own its share yet (`partitions / members`, and
/// one more for as many members as the division leaves over):
/// rendezvous hashing alone left one of three nodes with 2 of 16 partitions and another
/// with 8. A join or a leave still moves few partitions, each kept where its best-scoring
/// node has room. Deterministic, so every node computes the same.
pub fn assign(partitions: u32, members: &[(String, PartitionSet)]) -> Vec<Option<String>> {
    // Every node may own `least` partitions, and `extra` of them one more.
    let nodes = members.len().max(1);
    let (least, mut extra) = (partitions as usize / nodes, partitions as usize % nodes);
    let mut owned: BTreeMap<&str, usize> = BTreeMap::new();
    (0..partitions)
        .map(|p| {
            let mut ranked: Vec<&str> = members
                .iter()
                .filter(|(_, eligible)| eligible.contains(p))
                .map(|(node, _)| node.as_str())
                .collect();
            ranked.sort_by(|a, b| score(p, b).cmp(&score(p, a)).then(a.cmp(b)));
            let count = |node: &str| owned.get(node).copied().unwrap_or(0);
            // The best with room; if every eligible one is full (eligibility narrower than
            // the share), the best.
            let owner = match ranked.iter().find(|n| count(n) < least) {
                Some(node) => *node,
                None => match ranked.iter().find(|n| count(n) == least) {
                    Some(node) if extra > 0 => {
                        extra -= 1;
                        *node
                    }
                    _ => *ranked.first()?,
                },
            };
            *owned.entry(owner).or_default() += 1;
            Some(owner.to_owned())
        })
        .collect()
}

/// The live members of the nodes bucket `bucket`, as any process with the right to read
/// it sees them (`engram up --nodes`, status commands); an empty list when no node ever ran.
pub async fn live_members(bus: &Bus, bucket: &str) -> Result<Vec<Member>, BusError> {
    let Ok(store) = bus.jetstream().get_key_value(bucket).await else {
        return Ok(Vec::new());
    };
    members_of(&store).await
}

async fn members_of(store: &kv::Store) -> Result<Vec<Member>, BusError> {
    let mut members = Vec::new();
    for key in engram_bus::keys_with_prefix(store, "member.").await? {
        if let Some(value) = store.get(&key).await.map_err(js_err)?
            && let Ok(member) = serde_json::from_slice::<Member>(&value)
        {
            members.push(member);
        }
    }
    members.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(members)
}

/// The membership and leases bucket, as one node uses it.
#[derive(Clone)]
pub struct Ownership {
    store: kv::Store,
    pub me: Member,
    pub ttl: Duration,
}

/// What happened to a take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Taken (or reclaimed from this node's previous process) at this revision.
    Taken(u64),
    /// Another node holds it.
    Held,
}

fn member_key(node: &str) -> String {
    format!("member.{node}")
}

fn lease_key(partition: u32) -> String {
    format!("owner.p{partition}")
}

impl Ownership {
    /// Opens (or creates) `bucket`, whose entries live `ttl`.
    pub async fn open(
        bus: &Bus,
        bucket: &str,
        ttl: Duration,
        me: Member,
    ) -> Result<Self, BusError> {
        let js = bus.jetstream();
        let store = match js.get_key_value(bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_key_value(kv::Config {
                    bucket: bucket.to_owned(),
                    description: "engram memory nodes and the stream partitions they own".into(),
                    history: 1,
                    max_age: ttl,
                    num_replicas: bus.replicas(),
                    ..Default::default()
                })
                .await
                .map_err(js_err)?,
        };
        let configured = store.status().await.map_err(js_err)?.max_age();
        if configured != ttl {
            // The bucket's TTL is every lease's: nodes must agree on it.
            tracing::warn!(
                bucket,
                configured = ?configured,
                asked = ?ttl,
                "the nodes bucket has another TTL; leases live as the bucket says"
            );
        }
        Ok(Self {
            ttl: configured,
            store,
            me,
        })
    }

    /// Writes the node's membership entry again (it lives one TTL). Refused when the entry
    /// is another state dir's, written within the TTL: two nodes of one name would each
    /// think the other's leases their own.
    pub async fn announce(&self) -> Result<(), OwnershipError> {
        if let Some(entry) = self
            .store
            .entry(member_key(&self.me.node))
            .await
            .map_err(|e| OwnershipError::Bus(js_err(e)))?
            && entry.operation == kv::Operation::Put
            && let Ok(other) = serde_json::from_slice::<Member>(&entry.value)
            && other.state != self.me.state
        {
            return Err(OwnershipError::NameTaken {
                node: self.me.node.clone(),
                ttl: self.ttl,
            });
        }
        let value = serde_json::to_vec(&self.me).expect("a member serializes");
        self.store
            .put(member_key(&self.me.node), value.into())
            .await
            .map_err(|e| OwnershipError::Bus(js_err(e)))?;
        Ok(())
    }

    /// Removes the node's membership entry (an orderly stop): the others move its
    /// partitions at once instead of after the TTL.
    pub async fn leave(&self) {
        if let Err(e) = self.store.delete(member_key(&self.me.node)).await {
            tracing::debug!(error = %e, "membership entry not removed; it expires");
        }
    }

    /// The live members: every membership entry written within the TTL.
    pub async fn members(&self) -> Result<Vec<Member>, BusError> {
        members_of(&self.store).await
    }

    /// Who holds each leased partition now, by partition.
    pub async fn holders(&self) -> Result<BTreeMap<u32, Holder>, BusError> {
        let mut holders = BTreeMap::new();
        for key in engram_bus::keys_with_prefix(&self.store, "owner.p").await? {
            let Some(p) = key
                .strip_prefix("owner.p")
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(value) = self.store.get(lease_key(p)).await.map_err(js_err)?
                && let Ok(holder) = serde_json::from_slice::<Holder>(&value)
            {
                holders.insert(p, holder);
            }
        }
        Ok(holders)
    }

    fn holder_value(&self) -> bytes::Bytes {
        serde_json::to_vec(&Holder {
            node: self.me.node.clone(),
            state: self.me.state.clone(),
        })
        .expect("a holder serializes")
        .into()
    }

    /// Takes `partition`'s lease if it is free, or if this node's state dir held it (a
    /// restarted node reclaims its partitions at once instead of waiting out its own
    /// leases).
    pub async fn take(&self, partition: u32) -> Result<Take, BusError> {
        let key = lease_key(partition);
        match self.store.create(&key, self.holder_value()).await {
            Ok(revision) => return Ok(Take::Taken(revision)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(js_err(e)),
        }
        let Some(entry) = self.store.entry(&key).await.map_err(js_err)? else {
            return Ok(Take::Held);
        };
        if entry.operation != kv::Operation::Put || !self.is_ours(&entry.value) {
            return Ok(Take::Held);
        }
        match self
            .store
            .update(&key, self.holder_value(), entry.revision)
            .await
        {
            Ok(revision) => Ok(Take::Taken(revision)),
            Err(_) => Ok(Take::Held),
        }
    }

    /// Renews a held lease; the new revision, or `None` when it is no longer this node's
    /// (it expired, or another node took it).
    pub async fn renew(&self, partition: u32, revision: u64) -> Result<Option<u64>, BusError> {
        match self
            .store
            .update(lease_key(partition), self.holder_value(), revision)
            .await
        {
            Ok(revision) => Ok(Some(revision)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                // A renewal the server applied whose answer was lost (a timeout across a
                // leader change, say) moved the revision on: still this node's, at that
                // revision. Only another holder's value, or none, is a lost lease.
                match self.store.entry(lease_key(partition)).await {
                    Ok(Some(entry))
                        if entry.operation == kv::Operation::Put && self.is_ours(&entry.value) =>
                    {
                        Ok(Some(entry.revision))
                    }
                    Ok(_) => Ok(None),
                    Err(e) => Err(js_err(e)),
                }
            }
            Err(e) => Err(js_err(e)),
        }
    }

    /// Whether a lease's value names this node, in this life.
    fn is_ours(&self, value: &[u8]) -> bool {
        serde_json::from_slice::<Holder>(value)
            .is_ok_and(|h| h.node == self.me.node && h.state == self.me.state)
    }

    /// Gives a held lease up (after the partition stopped here), so the next owner takes it
    /// at once; nothing if it is no longer this node's. The lease's current revision is read
    /// first: a renewal may have moved it since the caller last saw it.
    pub async fn release(&self, partition: u32) {
        let key = lease_key(partition);
        for _ in 0..3 {
            let entry = match self.store.entry(&key).await {
                Ok(Some(entry)) if entry.operation == kv::Operation::Put => entry,
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(partition, error = %e, "lease not released; it expires");
                    return;
                }
            };
            if !self.is_ours(&entry.value) {
                return;
            }
            match self
                .store
                .delete_expect_revision(&key, Some(entry.revision))
                .await
            {
                Ok(()) => return,
                // Renewed in between: read it again.
                Err(e) => tracing::debug!(partition, error = %e, "lease moved while released"),
            }
        }
        tracing::debug!(partition, "lease not released; it expires");
    }

    /// Changes to the bucket, to act on a join, a leave or a release at once.
    pub async fn watch(&self) -> Result<kv::Watch, BusError> {
        self.store.watch_all().await.map_err(js_err)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    #[error(
        "another memory node named {node} is running with another state dir (its membership was renewed within the last {ttl:?}); give this node its own name (node.name) or its own state dir"
    )]
    NameTaken { node: String, ttl: Duration },
    #[error(transparent)]
    Bus(#[from] BusError),
}

fn js_err(e: impl std::fmt::Display) -> BusError {
    BusError::Unavailable(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(names: &[&str]) -> Vec<(String, PartitionSet)> {
        names
            .iter()
            .map(|n| ((*n).to_owned(), PartitionSet::all()))
            .collect()
    }

    fn shares(owners: &[Option<String>]) -> BTreeMap<String, usize> {
        let mut shares = BTreeMap::new();
        for owner in owners.iter().flatten() {
            *shares.entry(owner.clone()).or_default() += 1;
        }
        shares
    }

    #[test]
    fn every_partition_has_one_owner_shares_are_even_and_a_join_moves_few() {
        for partitions in [16, 64] {
            let two = assign(partitions, &members(&["a", "b"]));
            assert!(two.iter().all(Option::is_some));
            let three = assign(partitions, &members(&["a", "b", "c"]));
            // Even: each node's share within one of every other's.
            for owners in [&two, &three] {
                let shares = shares(owners);
                let (least, most) = (
                    shares.values().min().copied().unwrap(),
                    shares.values().max().copied().unwrap(),
                );
                assert!(most - least <= 1, "{partitions}: {shares:?}");
            }
            // The newcomer takes its share, and few others move besides.
            let moved = (0..partitions as usize)
                .filter(|&p| two[p] != three[p])
                .count();
            let share = (partitions as usize).div_ceil(3);
            assert!(moved <= 2 * share, "{partitions}: {moved} moved");
            // The same members in another order give the same owners.
            assert_eq!(three, assign(partitions, &members(&["c", "a", "b"])));
        }
    }

    #[test]
    fn a_member_owns_only_partitions_it_may_and_none_is_owned_by_nobody_eligible() {
        let members = vec![
            ("a".to_owned(), "0-3".parse().unwrap()),
            ("b".to_owned(), "2-5".parse().unwrap()),
        ];
        let owners = assign(8, &members);
        assert_eq!(owners[0].as_deref(), Some("a"));
        assert_eq!(owners[5].as_deref(), Some("b"));
        assert!(owners[2].is_some() && owners[3].is_some());
        assert_eq!(owners[6], None);
        assert_eq!(owners[7], None);
    }
}
