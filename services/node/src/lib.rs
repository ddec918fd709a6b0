//! A memory node: owns some of the events stream's partitions, hosts every read model of
//! them (vector, keyword, facts, skills, documents, consolidator), and answers whole queries
//! about them in process.
//!
//! # Layout
//! - [`ownership`]: membership and partition leases in a KV bucket, and the assignment every
//!   node computes alike (rendezvous hashing over the live members).
//! - this module: the node's loop. It takes the partitions assigned to it (each from its
//!   newest snapshot plus the tail, or its own checkpoint if that holds more), answers their
//!   queries once caught up, hands over those assigned to a node that joined, and stops
//!   answering a partition the moment its lease is no longer certainly its own.
//!
//! # Routing
//! An agent asks about its own scope on `engram.q.<tenant>.<agent>.<op>.<kind>.<id>`; the
//! server's mapping turns that into `engram.n.<partition>.…` with the partition of the scope,
//! which only the partition's owner subscribes to. The owner answers from its own read
//! models, in process (one round trip from the client), and asks other partitions' owners
//! (over NATS, in parallel) only for the scopes of a request's grants held elsewhere. Every
//! node also serves the query service's own subjects (`engram.q.…`) for whatever is not
//! routed. What may reach a node is the server's to decide: an agent's key may publish to
//! `engram.n.*.<tenant>.<agent>.…` only, and the node refuses a subject whose partition is
//! not its scope's.
//!
//! A node never answers for a partition it does not hold the lease of: it stops serving one
//! as soon as a renewal fails or is overdue, before the lease can expire and another node
//! take it.

pub mod ownership;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engram_bus::Bus;
use engram_projectors::{PartitionSet, RunningProjectors};
use engram_query::Query;
use engram_telemetry::metrics;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::ownership::{Member, Ownership, OwnershipError, Take};

/// `[node]` in engram.toml.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// This node's name among memory nodes (an ident). Unset: a name made up once and kept
    /// in the node's state dir, so a restarted node is the same node.
    pub name: Option<engram_schema::Ident>,
    /// How long a partition's lease and a node's membership live without renewal: a node
    /// that dies has its partitions taken over after at most this, plus a quarter of it.
    /// Every node of a deployment uses the bucket's (the first node's) value.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// The KV bucket of memberships and partition leases.
    pub bucket: String,
    /// How long after a node process of `engram up --nodes` died it is started again. A
    /// node back within its lease TTL reclaims its partitions itself; one back later finds
    /// them taken over, and they move back to it once it has caught up. A node that exited
    /// cleanly after running 10 s or more (SIGTERM: it handed its partitions back) is
    /// started again at once.
    #[serde(with = "humantime_serde")]
    pub restart_after: Duration,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            name: None,
            lease_ttl: Duration::from_secs(10),
            bucket: "ENGRAM_NODES".into(),
            restart_after: Duration::from_secs(1),
        }
    }
}

impl NodeConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.lease_ttl < Duration::from_secs(1) {
            return Err("node.lease_ttl must be at least 1s".into());
        }
        engram_schema::Ident::parse("node.bucket", &self.bucket)
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Ownership(#[from] OwnershipError),
    #[error("cannot reach the nodes bucket: {0}")]
    Bus(#[from] engram_bus::BusError),
    #[error("cannot serve the node's routed queries: {0}")]
    Service(#[from] engram_rpc::RpcError),
    #[error("cannot keep the node's name in {path}: {source}")]
    State {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Projectors(#[from] engram_projectors::StartError),
}

/// What a node runs: its read models (no partition hosted yet), the query service that
/// answers in process from them, the connection its routed endpoints answer on (the query
/// responder's identity) and a connection for its leases (the projectors' identity).
pub struct Parts {
    pub projectors: RunningProjectors,
    pub query: Arc<Query>,
    pub responder: async_nats::Client,
    pub bus: Bus,
}

/// A running memory node.
pub struct RunningNode {
    pub name: String,
    /// The partitions this node answers now (held and caught up).
    pub serving: watch::Receiver<BTreeSet<u32>>,
    /// Every hosted instance's visibility, for `/healthz`.
    pub instances: engram_projectors::Instances,
    task: tokio::task::JoinHandle<RunningProjectors>,
}

impl RunningNode {
    /// Waits for the node to stop (after the shutdown signal): every partition handed
    /// back, each model checkpointed.
    pub async fn join(self) -> Result<(), engram_projection_runtime::ProjectorError> {
        match self.task.await {
            Ok(projectors) => projectors.join().await,
            Err(e) => {
                tracing::error!(error = %e, "memory node task failed");
                Ok(())
            }
        }
    }

    /// The partitions served now.
    pub fn serving_now(&self) -> BTreeSet<u32> {
        self.serving.borrow().clone()
    }
}

/// The partitions some live memory node answers now, by what the nodes of bucket `bucket`
/// announce.
pub async fn serving(bus: &Bus, bucket: &str) -> Result<BTreeSet<u32>, engram_bus::BusError> {
    Ok(ownership::live_members(bus, bucket)
        .await?
        .into_iter()
        .flat_map(|m| m.serving)
        .collect())
}

/// The node's name (as [`start`] will use it) as an ident: what its projectors' consumer
/// names end in, so that no two nodes ever read through one consumer.
pub fn node_ident(
    state: &Path,
    configured: Option<&engram_schema::Ident>,
) -> Result<engram_schema::Ident, NodeError> {
    let (name, _) = identity(state, configured)?;
    engram_schema::Ident::parse("node", name).map_err(|e| NodeError::State {
        path: state.join("node").display().to_string(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
    })
}

/// The node's name and its state dir's id, made up once and kept in `<state>/node`.
fn identity(
    state: &Path,
    configured: Option<&engram_schema::Ident>,
) -> Result<(String, String), NodeError> {
    let path = state.join("node");
    let io = |source| NodeError::State {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(state).map_err(io)?;
    let kept = std::fs::read_to_string(&path).ok().and_then(|text| {
        let (name, id) = text.trim().split_once(' ')?;
        Some((name.to_owned(), id.to_owned()))
    });
    let (name, id) = match kept {
        Some(kept) => kept,
        None => {
            let id = uuid::Uuid::now_v7().simple().to_string();
            let name = format!("node-{}", &id[id.len() - 8..]);
            std::fs::write(&path, format!("{name} {id}\n")).map_err(io)?;
            (name, id)
        }
    };
    Ok((configured.map_or(name, ToString::to_string), id))
}

/// Starts a memory node: announces it, takes the partitions assigned to it that are free
/// (waiting until each is caught up and answering), and keeps its share as nodes come and
/// go until `shutdown`, when it hands every partition back. `eligible` are the partitions
/// it may own; `state` its state dir (where its name is kept); `http` where its
/// `/healthz` is, if anywhere.
pub async fn start(
    config: &NodeConfig,
    eligible: PartitionSet,
    state: &Path,
    http: Option<String>,
    parts: Parts,
    shutdown: CancellationToken,
) -> Result<RunningNode, NodeError> {
    let (name, state_id) = identity(state, config.name.as_ref())?;
    let partitions = parts.bus.config().stream.partitions;
    eligible
        .within(partitions)
        .map_err(engram_projectors::StartError::from)?;
    let me = Member {
        node: name.clone(),
        state: state_id,
        partitions: eligible.to_string(),
        http,
        serving: Vec::new(),
    };
    let ownership = join(&parts.bus, config, me).await?;
    let service = engram_rpc::start_service(
        &parts.responder,
        "engram-node",
        &format!("engram memory node {name}: routed queries of the partitions it owns"),
    )
    .await?;
    let (serving_tx, serving) = watch::channel(BTreeSet::new());
    let (ready_tx, ready_rx) = mpsc::unbounded_channel();
    let instances = parts.projectors.instances();
    let mut node = Node {
        ownership,
        projectors: parts.projectors,
        query: parts.query,
        responder: parts.responder,
        service,
        bus: parts.bus,
        partitions,
        eligible,
        leases: Arc::new(Mutex::new(BTreeMap::new())),
        held: BTreeMap::new(),
        serving: serving_tx,
        ready_tx,
        ready_rx,
        shutdown: shutdown.clone(),
        members: BTreeSet::new(),
    };
    let (news_tx, news_rx) = mpsc::unbounded_channel();
    let keeper = tokio::spawn(keep(
        node.ownership.clone(),
        node.leases.clone(),
        news_tx,
        shutdown.clone(),
    ));
    // The partitions free now are taken before start returns, and answer by then: a node
    // started alone (`engram up`) answers everything once started.
    node.round().await;
    let taking: BTreeSet<u32> = node.held.keys().copied().collect();
    while node.serving.borrow().len() < taking.len() {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some((p, at)) = node.ready_rx.recv() => node.ready(p, at).await,
        }
    }
    let serving_now = node.serving.borrow().clone();
    tracing::info!(node = %name, partitions = ?serving_now, "memory node up");
    let task = tokio::spawn(node.run(news_rx, keeper));
    Ok(RunningNode {
        name,
        serving,
        instances,
        task,
    })
}

/// A lease this node holds: its revision, when the write that made it so was sent, and
/// whether it went unconfirmed for too long (its partition not answering meanwhile).
#[derive(Clone, Copy, Debug)]
struct Lease {
    revision: u64,
    sent: Instant,
    unconfirmed: bool,
}

/// A partition held: when it was taken, and what ends its routed endpoints.
struct Held {
    taken: Instant,
    routes: CancellationToken,
}

struct Node {
    ownership: Ownership,
    projectors: RunningProjectors,
    query: Arc<Query>,
    responder: async_nats::Client,
    service: async_nats::service::Service,
    bus: Bus,
    partitions: u32,
    eligible: PartitionSet,
    /// Leases held, renewed by [`keep`]; shared with it.
    leases: Arc<Mutex<BTreeMap<u32, Lease>>>,
    held: BTreeMap<u32, Held>,
    serving: watch::Sender<BTreeSet<u32>>,
    /// A partition caught up, with when its catch-up ended.
    ready_tx: mpsc::UnboundedSender<(u32, Instant)>,
    ready_rx: mpsc::UnboundedReceiver<(u32, Instant)>,
    shutdown: CancellationToken,
    /// The members seen at the last round: a new one, or one gone, calls a round at once.
    members: BTreeSet<String>,
}

impl Node {
    async fn run(
        mut self,
        mut news: mpsc::UnboundedReceiver<LeaseNews>,
        keeper: tokio::task::JoinHandle<()>,
    ) -> RunningProjectors {
        let mut tick = tokio::time::interval(self.ownership.ttl / 4);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut changes = match self.ownership.watch().await {
            Ok(watch) => Some(watch),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the nodes bucket; acting on ticks only");
                None
            }
        };
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => break,
                _ = tick.tick() => {
                    if let Err(e) = self.ownership.announce().await {
                        tracing::warn!(error = %e, "membership not renewed");
                    }
                    self.round().await;
                }
                Some(news) = news.recv() => match news {
                    LeaseNews::Lost(p) => self.lose(p).await,
                    LeaseNews::Unconfirmed(p) => self.answer(p, false).await,
                    LeaseNews::Confirmed(p) => self.answer(p, true).await,
                },
                Some((p, at)) = self.ready_rx.recv() => self.ready(p, at).await,
                Some(change) = async { changes.as_mut()?.next().await }, if changes.is_some() => {
                    if let Ok(entry) = change && self.matters(&entry) {
                        self.round().await;
                    }
                }
            }
        }
        // An orderly stop: leave first, so the others take the partitions as they are
        // handed back rather than after the TTL.
        self.ownership.leave().await;
        for p in self.held.keys().copied().collect::<Vec<_>>() {
            self.hand_over(p).await;
        }
        keeper.abort();
        if let Err(e) = self.service.stop().await {
            tracing::debug!(error = %e, "node service did not stop cleanly");
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), self.responder.flush()).await;
        self.projectors
    }

    /// Whether a change in the bucket calls for a round now: a member joined or left, or a
    /// lease was given up.
    fn matters(&self, entry: &async_nats::jetstream::kv::Entry) -> bool {
        use async_nats::jetstream::kv::Operation;
        if let Some(node) = entry.key.strip_prefix("member.") {
            return entry.operation != Operation::Put || !self.members.contains(node);
        }
        entry.key.starts_with("owner.") && entry.operation != Operation::Put
    }

    /// Takes the free partitions assigned to this node and hands over those assigned to
    /// another live member.
    async fn round(&mut self) {
        let mut members = match self.ownership.members().await {
            Ok(members) => members,
            Err(e) => {
                tracing::debug!(error = %e, "members unknown; no moves this round");
                return;
            }
        };
        // This node is alive whatever the bucket says: its own announcement may have lapsed
        // (its server frozen or cut off for longer than the TTL), and reading itself as gone
        // would hand every partition it serves away and take them back a round later.
        // Whether it may go on serving is its leases' business.
        if !members.iter().any(|m| m.node == self.ownership.me.node) {
            members.push(self.ownership.me.clone());
        }
        self.members = members.iter().map(|m| m.node.clone()).collect();
        let eligible: Vec<(String, PartitionSet)> = members
            .iter()
            .map(|m| {
                let set = if m.node == self.ownership.me.node {
                    self.eligible.clone()
                } else {
                    m.eligible()
                };
                (m.node.clone(), set)
            })
            .collect();
        let owners = ownership::assign(self.partitions, &eligible);
        let me = self.ownership.me.node.clone();
        for (p, owner) in owners.iter().enumerate() {
            let p = p as u32;
            let mine = owner.as_deref() == Some(me.as_str());
            if !mine && self.held.contains_key(&p) && owner.is_some() {
                self.hand_over(p).await;
            } else if mine && !self.held.contains_key(&p) {
                self.take(p).await;
            }
        }
    }

    async fn take(&mut self, p: u32) {
        let sent = Instant::now();
        let revision = match self.ownership.take(p).await {
            Ok(Take::Taken(revision)) => revision,
            Ok(Take::Held) => return,
            Err(e) => {
                tracing::debug!(partition = p, error = %e, "lease not taken");
                return;
            }
        };
        let taken = Instant::now();
        lock(&self.leases).insert(
            p,
            Lease {
                revision,
                sent,
                unconfirmed: false,
            },
        );
        let catch_up = match self.projectors.take_partition(p).await {
            Ok(catch_up) => catch_up,
            Err(e) => {
                tracing::error!(partition = p, error = %e, "cannot host the partition; giving its lease back");
                let held = lock(&self.leases).remove(&p).is_some();
                if held {
                    self.ownership.release(p).await;
                }
                return;
            }
        };
        tracing::info!(node = %self.ownership.me.node, partition = p, "partition taken; catching up");
        owned(p, true);
        metrics::NODE_PARTITION_MOVES
            .with_label_values(&["in"])
            .inc();
        self.held.insert(
            p,
            Held {
                taken,
                routes: self.shutdown.child_token(),
            },
        );
        let (bus, ready) = (self.bus.clone(), self.ready_tx.clone());
        tokio::spawn(async move {
            if catch_up.run(&bus).await.is_some() {
                let _ = ready.send((p, Instant::now()));
            }
        });
    }

    /// A partition caught up: its routed queries come here from now on.
    async fn ready(&mut self, p: u32, at: Instant) {
        let Some(held) = self.held.get(&p) else {
            return;
        };
        if let Err(e) = self
            .query
            .serve_routed_ops(&self.service, Some(p), Some(held.routes.clone()))
            .await
        {
            tracing::error!(partition = p, error = %e, "cannot serve the partition's routed queries");
            return;
        }
        // Answering means a request from any connection finds the endpoints.
        if let Err(e) = engram_rpc::settle(
            &self.responder,
            self.bus.client(),
            engram_rpc::SETTLE_WITHIN,
        )
        .await
        {
            tracing::warn!(partition = p, error = %e, "the server did not confirm the partition's endpoints");
        }
        let took = at.duration_since(held.taken);
        metrics::NODE_TAKEOVER_SECONDS.observe(took.as_secs_f64());
        tracing::info!(node = %self.ownership.me.node, partition = p, took_ms = took.as_millis() as u64, "partition answering");
        self.serving.send_modify(|s| {
            s.insert(p);
        });
        self.announce_serving().await;
    }

    /// Announces what the node answers now, at once rather than at the next tick.
    async fn announce_serving(&mut self) {
        self.ownership.me.serving = self.serving.borrow().iter().copied().collect();
        if let Err(e) = self.ownership.announce().await {
            tracing::debug!(error = %e, "membership not announced");
        }
    }

    /// Stops serving `p` (its routed queries first, then its models, each checkpointing),
    /// then gives its lease up for the next owner.
    async fn hand_over(&mut self, p: u32) {
        self.stop_serving(p).await;
        let held = lock(&self.leases).remove(&p).is_some();
        if held {
            self.ownership.release(p).await;
        }
        metrics::NODE_PARTITION_MOVES
            .with_label_values(&["out"])
            .inc();
        tracing::info!(node = %self.ownership.me.node, partition = p, "partition handed over");
    }

    /// Lets `p`'s instances answer queries, or not, while the node keeps it (its lease
    /// unconfirmed, then confirmed again).
    async fn answer(&mut self, p: u32, answering: bool) {
        if !self.held.contains_key(&p) {
            return;
        }
        self.projectors.set_answering(p, answering);
        if answering {
            tracing::info!(node = %self.ownership.me.node, partition = p, "partition lease confirmed again; answering");
        } else {
            tracing::warn!(node = %self.ownership.me.node, partition = p, "partition lease not confirmed in time; not answering until it is");
        }
        self.serving.send_modify(|s| {
            if answering {
                s.insert(p);
            } else {
                s.remove(&p);
            }
        });
        self.announce_serving().await;
    }

    /// `p`'s lease is another node's now: stop at once.
    async fn lose(&mut self, p: u32) {
        if !self.held.contains_key(&p) {
            return;
        }
        lock(&self.leases).remove(&p);
        self.stop_serving(p).await;
        metrics::NODE_PARTITION_MOVES
            .with_label_values(&["lost"])
            .inc();
        tracing::warn!(node = %self.ownership.me.node, partition = p, "partition lease lost; stopped serving it");
    }

    async fn stop_serving(&mut self, p: u32) {
        let Some(held) = self.held.remove(&p) else {
            return;
        };
        held.routes.cancel();
        self.serving.send_modify(|s| {
            s.remove(&p);
        });
        if !self.shutdown.is_cancelled() {
            self.announce_serving().await;
        }
        owned(p, false);
        if let Err(e) = self.projectors.remove_partition(p).await {
            tracing::warn!(partition = p, error = %e, "a model of the partition stopped with an error");
        }
    }
}

/// The ownership metrics of partition `p`, taken (`true`) or let go: how many this node owns,
/// and which. A partition let go loses its series rather than reading 0, so that across
/// nodes there is one series per owned partition: `count by (partition)` counts its owners,
/// and a node that never owned it adds nothing.
fn owned(p: u32, owned: bool) {
    let partition = p.to_string();
    if owned {
        metrics::NODE_PARTITIONS_OWNED.inc();
        metrics::NODE_PARTITION_OWNED
            .with_label_values(&[&partition])
            .set(1);
    } else {
        metrics::NODE_PARTITIONS_OWNED.dec();
        // Absent only if it was never set, which `held` rules out.
        let _ = metrics::NODE_PARTITION_OWNED.remove_label_values(&[&partition]);
    }
}

/// How long a node starting tries to join while the nodes bucket does not answer.
const JOIN_WITHIN: Duration = Duration::from_secs(60);

/// Opens the nodes bucket and announces this node. A bucket just created, by this node or one
/// starting beside it, answers reads only once its stream has a leader (moments, on a
/// cluster just formed): until then they find no responders. That is retried, for
/// [`JOIN_WITHIN`]; a name held by another node is not.
async fn join(bus: &Bus, config: &NodeConfig, me: Member) -> Result<Ownership, NodeError> {
    let deadline = Instant::now() + JOIN_WITHIN;
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let ownership =
                Ownership::open(bus, &config.bucket, config.lease_ttl, me.clone()).await?;
            ownership.announce().await?;
            Ok::<_, OwnershipError>(ownership)
        };
        match attempt.await {
            Ok(ownership) => return Ok(ownership),
            Err(OwnershipError::Bus(e)) if e.is_retryable() && Instant::now() < deadline => {
                tracing::info!(error = %e, bucket = %config.bucket, "nodes bucket not answering yet; trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the keeper learnt of a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LeaseNews {
    /// Another node holds it now (or it expired and was taken): stop and let go.
    Lost(u32),
    /// Not confirmed for most of its TTL (the server unreachable or slow, this process
    /// starved or frozen): it may expire before a renewal lands, so stop answering until one
    /// does. The models keep applying meanwhile, so answering resumes with nothing to catch up.
    Unconfirmed(u32),
    /// Renewed after it was unconfirmed: answer again.
    Confirmed(u32),
}

/// Renews every held lease each quarter of the TTL, all at once and apart from the node's
/// loop (which may be busy stopping or starting a partition). A lease lives one TTL from
/// the server's write of its last renewal, which is after that renewal was sent: so a lease
/// not confirmed within nine tenths of the TTL from the last successful renewal's sending is
/// reported unconfirmed, and stops answering before it could have expired; one another node
/// holds is reported lost.
async fn keep(
    ownership: Ownership,
    leases: Arc<Mutex<BTreeMap<u32, Lease>>>,
    news: mpsc::UnboundedSender<LeaseNews>,
    stop: CancellationToken,
) {
    let every = ownership.ttl / 4;
    let unconfirmed_after = ownership.ttl * 9 / 10;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let held: Vec<(u32, Lease)> = lock(&leases).iter().map(|(p, l)| (*p, *l)).collect();
        let renewals = held.into_iter().map(|(p, lease)| {
            let (ownership, leases, news) = (&ownership, &leases, &news);
            async move {
                if !lease.unconfirmed && lease.sent.elapsed() > unconfirmed_after {
                    if let Some(l) = lock(leases).get_mut(&p) {
                        l.unconfirmed = true;
                    }
                    let _ = news.send(LeaseNews::Unconfirmed(p));
                }
                let sent = Instant::now();
                match ownership.renew(p, lease.revision).await {
                    Ok(Some(revision)) => {
                        let mut leases = lock(leases);
                        if let Some(l) = leases.get_mut(&p)
                            && l.revision == lease.revision
                        {
                            if l.unconfirmed {
                                let _ = news.send(LeaseNews::Confirmed(p));
                            }
                            *l = Lease {
                                revision,
                                sent,
                                unconfirmed: false,
                            };
                        }
                    }
                    Ok(None) => {
                        lock(leases).remove(&p);
                        let _ = news.send(LeaseNews::Lost(p));
                    }
                    // Not reached the server: tried again next tick.
                    Err(e) => tracing::debug!(partition = p, error = %e, "lease not renewed"),
                }
            }
        });
        futures::future::join_all(renewals).await;
    }
}
