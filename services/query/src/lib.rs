//! The query service: what agents call to remember.
//!
//! # Layout
//! - [`fusion`]: hybrid ranking (pure).
//! - [`context`]: `build_context`, the per-step call that assembles all four memory layers
//!   within a token budget.
//! - `brief`: a task's handoff brief (`engram.q.brief`), read with the caller's rights.
//! - [`replay`]: replay pages, read with direct gets (no consumer per page), and each
//!   agent's and tenant's share of them.
//! - [`usage`]: how often each memory was returned, written to the log as periodic
//!   aggregated `feedback {retrieved}` events, never one write per query.
//! - this module: the service (`engram-query` on NATS), scope resolution, fan-out to the
//!   projector services and read-your-writes propagation.
//!
//! Scope rules are enforced here, before any projector is asked: a request names its own
//! scope and the ancestors it is granted; anything else is refused
//! ([`ScopeRequest::resolve`]). Projectors then match scope keys exactly.

pub mod access;
pub mod append;
mod brief;
pub mod context;
pub mod fusion;
pub mod replay;
mod route;
mod slices;
pub mod usage;
pub mod when;

use std::sync::Arc;
use std::time::Duration;

use engram_bus::{Bus, StreamHead};
use engram_embed::TokenCounter;
use engram_memory::ScopeKey;
use engram_memory::proto::{
    self, BootstrapRequest, BootstrapResponse, Consistency, ConsolidateRequest,
    ConsolidateResponse, Context, ContextRequest, DocRequest, DocResponse, ErrorCode, FactsRequest,
    FactsResponse, Ranking, RetrievalMode, RetrieveRequest, RetrieveResponse, SearchRequest,
    SearchResponse, SkillsRequest, SkillsResponse, read_models,
};
use engram_rpc::{EndpointLimits, Failure};
use engram_schema::{Ident, Scope};
use engram_telemetry::metrics;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::fusion::Side;

/// Subjects one scope listing reads at most (each is one scope and layer).
const MAX_LISTED_SUBJECTS: usize = 100_000;

/// Dead letters one listing scans, newest first: `total` counts within them.
const MAX_SCANNED_DEAD_LETTERS: u64 = 50_000;

/// Characters of a dead letter's text a listing shows.
const DEAD_LETTER_TEXT_CHARS: usize = 300;

/// The scope of an event subject.
fn scope_of_subject(subject: &str) -> Option<Scope> {
    engram_schema::parse_subject(subject).map(|(_, scope, _)| scope)
}

/// The shortest `query.usage_interval`: usage events are aggregates, not a write per query.
pub const MIN_USAGE_INTERVAL: Duration = Duration::from_millis(100);

/// `[query]` in engram.toml.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueryConfig {
    /// Default ranking; a request can override it.
    pub ranking: Ranking,
    /// Longest a request to a projector may take beyond its read-your-writes wait.
    #[serde(with = "humantime_serde")]
    pub projector_timeout: Duration,
    /// Most results one retrieval may ask for (at most 1000).
    pub max_top_k: usize,
    /// Memories below this confidence (0..=1) are left out of contexts: a context is what a
    /// model reads, so it carries no memory later outcomes contradicted twice, or a faulty
    /// instance wrote (`engram_memory::confidence`). 0 leaves none out.
    pub context_min_confidence: f64,
    /// Requests each endpoint handles at once; more are answered `busy` (429) at once.
    pub max_in_flight: usize,
    /// How often the memories `retrieve` and `context` returned are written to the log, as
    /// one `feedback {retrieved}` event per scope ([`usage`]); 0 counts nothing.
    #[serde(with = "humantime_serde")]
    pub usage_interval: Duration,
    /// The instance id of the events this service writes (agent `query`). Give each
    /// replica its own.
    pub instance_id: Ident,
    /// Shortest time between two snapshot cuts agents ask for (`engram.q.snapshot`): a cut
    /// copies every read model, so within it an unlabelled request gets the last cut's
    /// answer and a labelled one is refused as busy. 0 never holds one back.
    #[serde(with = "humantime_serde")]
    pub snapshot_min_interval: Duration,
}

impl Default for QueryConfig {
    fn default() -> Self {
        Self {
            ranking: Ranking::default(),
            projector_timeout: Duration::from_secs(10),
            max_top_k: 1000,
            context_min_confidence: 0.3,
            max_in_flight: 64,
            usage_interval: Duration::from_secs(60),
            instance_id: Ident::parse("instance_id", usage::AGENT).expect("a valid ident"),
            snapshot_min_interval: Duration::from_secs(60),
        }
    }
}

impl QueryConfig {
    pub fn validate(&self) -> Result<(), String> {
        self.ranking.validate().map_err(|e| format!("query.{e}"))?;
        if self.max_top_k == 0 || self.max_top_k > proto::limits::MAX_TOP_K {
            return Err(format!(
                "query.max_top_k must be 1..={}",
                proto::limits::MAX_TOP_K
            ));
        }
        if !(0.0..=1.0).contains(&self.context_min_confidence) {
            return Err("query.context_min_confidence must be a number in 0..=1".into());
        }
        if self.max_in_flight == 0 {
            return Err("query.max_in_flight must be at least 1".into());
        }
        if !self.usage_interval.is_zero() && self.usage_interval < MIN_USAGE_INTERVAL {
            return Err(format!(
                "query.usage_interval must be 0 (off) or at least {MIN_USAGE_INTERVAL:?}"
            ));
        }
        Ok(())
    }

    fn endpoint_limits(&self) -> EndpointLimits {
        EndpointLimits {
            max_in_flight: self.max_in_flight,
            max_duration: self.projector_timeout
                + Duration::from_millis(proto::limits::MAX_WAIT_MS)
                + Duration::from_secs(5),
        }
    }
}

/// The query service's shared state.
pub struct Query {
    client: async_nats::Client,
    bus: Bus,
    config: QueryConfig,
    tokens: Arc<TokenCounter>,
    /// Tells tokens that an append returned from ones no append can have returned.
    head: StreamHead,
    /// What the endpoints returned since the last usage flush.
    usage: Arc<usage::Usage>,
    /// When agents last had a snapshot cut, and its answer: one cut at a time, and none
    /// sooner than `snapshot_min_interval` after the last.
    last_cut: tokio::sync::Mutex<Option<(std::time::Instant, proto::SnapshotCutResponse)>>,
    /// The registry agents' requests are checked against; unset when run without
    /// authentication.
    access: std::sync::OnceLock<access::Guard>,
    /// Where the snapshot index is (`[projectors.snapshots]`), and the index once opened.
    snapshots_config: std::sync::OnceLock<engram_snapshots::SnapshotsConfig>,
    snapshots: tokio::sync::OnceCell<engram_snapshots::SnapshotStore>,
    /// Replay pages in flight, by agent and by tenant, each bounded.
    replay_shares: replay::Shares,
    /// The read models' endpoints hosted in this process (a memory node's partitions),
    /// asked without NATS; unset when none are.
    local: std::sync::OnceLock<engram_rpc::LocalRoutes>,
    /// Each routed op's in-flight slots, shared by its subjects of every partition: a node
    /// owning many partitions holds `query.max_in_flight` requests of an op at once, not
    /// that many per partition.
    routed_permits: std::collections::BTreeMap<&'static str, Arc<tokio::sync::Semaphore>>,
}

impl Query {
    /// Loads the tokenizer (fetched into the cache on first use) and connects nothing new:
    /// `bus` is used for projector requests and working memory.
    pub async fn new(bus: Bus, config: QueryConfig) -> Result<Arc<Self>, engram_embed::EmbedError> {
        let tokens = tokio::task::spawn_blocking(TokenCounter::load_default).await??;
        let routed_permits = ROUTED_OPS
            .iter()
            .map(|op| {
                let slots = tokio::sync::Semaphore::new(config.max_in_flight.max(1));
                (*op, Arc::new(slots))
            })
            .collect();
        Ok(Arc::new(Self {
            client: bus.client().clone(),
            head: StreamHead::new(bus.clone()),
            usage: Arc::new(usage::Usage::new(
                config.instance_id.clone(),
                !config.usage_interval.is_zero(),
            )),
            bus,
            config,
            tokens: Arc::new(tokens),
            last_cut: tokio::sync::Mutex::new(None),
            access: std::sync::OnceLock::new(),
            snapshots_config: std::sync::OnceLock::new(),
            snapshots: tokio::sync::OnceCell::new(),
            replay_shares: replay::Shares::default(),
            local: std::sync::OnceLock::new(),
            routed_permits,
        }))
    }

    /// Registers the service's endpoints on `responder` and serves them until `shutdown` is
    /// cancelled (or the connection closes); the returned task ends once they are stopped
    /// and the last retrieval usage is appended. `responder` is a connection of its own, of
    /// the query responder identity (inboxes only), never the one the service works with:
    /// see [`engram_rpc::Link`].
    pub async fn serve(
        self: &Arc<Self>,
        responder: &async_nats::Client,
        shutdown: CancellationToken,
    ) -> Result<tokio::task::JoinHandle<()>, engram_rpc::RpcError> {
        let service = engram_rpc::start_service(
            responder,
            proto::QUERY_SERVICE,
            "engram memory queries: retrieve, context, facts, skills, shared documents",
        )
        .await?;
        let limits = self.config.endpoint_limits();
        // Each endpoint twice: on `engram.q.<op>` for the admin and services, and on
        // `engram.q.<tenant>.<agent>.<op>` for agents, where the caller is checked first.
        macro_rules! endpoint {
            ($subject:expr, $op:literal, $req:ty, |$q:ident, $r:ident| $body:expr) => {{
                let q = self.clone();
                engram_rpc::serve(&service, $subject, $op, limits, move |$r: $req| {
                    let $q = q.clone();
                    async move { $body }
                })
                .await?;
                let q = self.clone();
                engram_rpc::serve_from(
                    &service,
                    &engram_access::perms::query_subject_any($op),
                    $op,
                    limits,
                    move |subject: &str, $r: $req| {
                        let $q = q.clone();
                        let subject = subject.to_owned();
                        async move {
                            $q.authorize(&subject, &$r).await?;
                            $body
                        }
                    },
                )
                .await?;
            }};
        }
        endpoint!(proto::RETRIEVE, "retrieve", RetrieveRequest, |q, r| q
            .retrieve_counted(r)
            .await);
        endpoint!(proto::CONTEXT, "context", ContextRequest, |q, r| q
            .build_context(r)
            .await);
        endpoint!(proto::FACTS, "facts", FactsRequest, |q, r| q.facts(r).await);
        endpoint!(proto::SKILLS, "skills", SkillsRequest, |q, r| q
            .skills(r)
            .await);
        // Routed queries a server without the routing mapping delivers as the agent sent
        // them (`engram.q.<tenant>.<agent>.<op>.<kind>.<id>`): answered here, fanning out.
        self.serve_routed_ops(&service, None, None).await?;
        // Consolidation: a plan, and with `apply` its events appended by this service (they
        // are the consolidator's, which no agent's key may author); an agent's only into
        // scopes its key may write (`consolidate_as`).
        let q = self.clone();
        engram_rpc::serve(
            &service,
            proto::CONSOLIDATE,
            "consolidate",
            limits,
            move |r: ConsolidateRequest| {
                let q = q.clone();
                async move { q.consolidate_as(None, r).await }
            },
        )
        .await?;
        let q = self.clone();
        engram_rpc::serve_from(
            &service,
            &engram_access::perms::query_subject_any("consolidate"),
            "consolidate",
            limits,
            move |subject: &str, r: ConsolidateRequest| {
                let q = q.clone();
                let subject = subject.to_owned();
                async move {
                    q.authorize(&subject, &r).await?;
                    q.consolidate_as(Some(&subject), r).await
                }
            },
        )
        .await?;
        endpoint!(proto::BOOTSTRAP, "bootstrap", BootstrapRequest, |q, r| q
            .bootstrap(r)
            .await);
        endpoint!(proto::DOC, "doc", DocRequest, |q, r| q.doc(r).await);
        endpoint!(proto::REPLAY, "replay", proto::ReplayRequest, |q, r| q
            .replay(r)
            .await);
        // The brief: an agent's reads it with its own rights and replay share, so the
        // subject it came on goes with it.
        let q = self.clone();
        engram_rpc::serve(
            &service,
            proto::BRIEF,
            "brief",
            limits,
            move |r: proto::BriefRequest| {
                let q = q.clone();
                async move { q.brief(None, r).await }
            },
        )
        .await?;
        let q = self.clone();
        engram_rpc::serve_from(
            &service,
            &engram_access::perms::query_subject_any("brief"),
            "brief",
            limits,
            move |subject: &str, r: proto::BriefRequest| {
                let q = q.clone();
                let subject = subject.to_owned();
                async move {
                    q.authorize(&subject, &r).await?;
                    q.brief(Some(&subject), r).await
                }
            },
        )
        .await?;
        // Appends, by agents only (the admin and services publish to the log themselves).
        let q = self.clone();
        engram_rpc::serve_from(
            &service,
            &engram_access::perms::query_subject_any(append::op()),
            "append",
            limits,
            move |subject: &str, r: proto::AppendRequest| {
                let q = q.clone();
                let subject = subject.to_owned();
                async move { q.append_as(&subject, r).await }
            },
        )
        .await?;
        // Working memory: reads like any other path; a put or delete by an agent also
        // needs a scope its key may write (checked in `working_as`).
        let q = self.clone();
        engram_rpc::serve(
            &service,
            proto::WORKING,
            "working",
            limits,
            move |r: proto::WorkingRequest| {
                let q = q.clone();
                async move { q.working(r).await }
            },
        )
        .await?;
        let q = self.clone();
        engram_rpc::serve_from(
            &service,
            &engram_access::perms::query_subject_any("working"),
            "working",
            limits,
            move |subject: &str, r: proto::WorkingRequest| {
                let q = q.clone();
                let subject = subject.to_owned();
                async move {
                    q.authorize(&subject, &r).await?;
                    if matches!(r.op, proto::WorkingOp::Put | proto::WorkingOp::Delete) {
                        match q.access.get() {
                            Some(guard) => guard.authorize_write(&subject, &r.scopes).await?,
                            None => {
                                access::authenticated_tenant(&subject, &r.scopes)?;
                            }
                        }
                    }
                    q.working(r).await
                }
            },
        )
        .await?;
        // Listings: the tenant's scopes, the snapshot index and the dead letters. The admin
        // sees every scope of the tenant; an agent, those it may read.
        macro_rules! listing {
            ($subject:expr, $op:literal, $req:ty, |$q:ident, $r:ident, $who:ident| $body:expr) => {{
                let q = self.clone();
                engram_rpc::serve(&service, $subject, $op, limits, move |$r: $req| {
                    let $q = q.clone();
                    async move {
                        let $who: Option<String> = None;
                        $body
                    }
                })
                .await?;
                let q = self.clone();
                engram_rpc::serve_from(
                    &service,
                    &engram_access::perms::query_subject_any($op),
                    $op,
                    limits,
                    move |subject: &str, $r: $req| {
                        let $q = q.clone();
                        let $who = Some(subject.to_owned());
                        async move { $body }
                    },
                )
                .await?;
            }};
        }
        listing!(
            proto::SCOPES,
            "scopes",
            proto::ScopesRequest,
            |q, r, who| q.scopes(r, who.as_deref()).await
        );
        listing!(
            proto::DEAD_LETTERS,
            "dead_letters",
            proto::DeadLettersRequest,
            |q, r, who| q.dead_letters(r, who.as_deref()).await
        );
        listing!(
            proto::SNAPSHOTS,
            "snapshots",
            proto::SnapshotsRequest,
            |q, r, _who| q.snapshots(r).await
        );
        let q = self.clone();
        engram_rpc::serve_from(
            &service,
            &engram_access::perms::query_subject_any("whoami"),
            "whoami",
            limits,
            move |subject: &str, _: proto::WhoamiRequest| {
                let q = q.clone();
                let subject = subject.to_owned();
                async move { q.whoami(&subject).await }
            },
        )
        .await?;
        // Cutting a snapshot copies every tenant's read models: the admin's alone. An agent
        // asking is told so, rather than left waiting for an answer nobody sends.
        engram_rpc::serve_from(
            &service,
            &engram_access::perms::query_subject_any("snapshot"),
            "snapshot",
            limits,
            |_: &str, _: serde_json::Value| async {
                Err::<serde_json::Value, _>(Failure::new(
                    ErrorCode::Forbidden,
                    "cutting snapshots copies every tenant's read models: an admin does it (`engram snapshot create`); agents bootstrap from the newest one",
                ))
            },
        )
        .await?;
        let q = self.clone();
        engram_rpc::serve(
            &service,
            proto::SNAPSHOT,
            "snapshot",
            limits,
            move |r: proto::SnapshotCutRequest| {
                let q = q.clone();
                async move { q.snapshot(r).await }
            },
        )
        .await?;
        // Served means answering: a request from any connection finds the endpoints.
        engram_rpc::settle(responder, &self.client, engram_rpc::SETTLE_WITHIN).await?;
        // The flusher stops after the endpoints, so that what they answered last is counted.
        let flusher_stop = CancellationToken::new();
        let flusher = (!self.config.usage_interval.is_zero()).then(|| {
            tokio::spawn(self.usage.clone().run(
                self.bus.clone(),
                self.config.usage_interval,
                flusher_stop.clone(),
            ))
        });
        Ok(tokio::spawn(async move {
            shutdown.cancelled().await;
            if let Err(e) = service.stop().await {
                tracing::debug!(error = %e, "query service did not stop cleanly");
            }
            flusher_stop.cancel();
            if let Some(flusher) = flusher
                && let Err(e) = flusher.await
            {
                tracing::warn!(error = %e, "retrieval usage flusher failed");
            }
        }))
    }

    /// Serves the routed query ops (retrieve, context, facts, skills, doc) on `service`:
    /// for `partition`, on `engram.n.<partition>.…` (what the server's mapping makes of an
    /// agent's routed query about a scope of that partition), until `stop`, as the memory
    /// node owning the partition does; for `None`, on the unmapped
    /// `engram.q.<tenant>.<agent>.<op>.<kind>.<id>`. Each request is checked as an agent's
    /// (tenant and agent from the subject, grants from the registry), and its own scope
    /// must be the subject's; on `engram.n.<partition>` the subject's scope must be of that
    /// partition, which no key can choose otherwise (see [`Query::check_routed`]).
    pub async fn serve_routed_ops(
        self: &Arc<Self>,
        service: &async_nats::service::Service,
        partition: Option<u32>,
        stop: Option<CancellationToken>,
    ) -> Result<(), engram_rpc::RpcError> {
        let limits = self.config.endpoint_limits();
        let stop = stop.unwrap_or_default();
        let routes = |op: &str| {
            let routes = engram_rpc::Routes::until(stop.clone());
            match self.routed_permits.get(op) {
                Some(permits) => routes.sharing(permits.clone()),
                None => routes,
            }
        };
        let subjects = |op: &str| match partition {
            Some(p) => engram_access::perms::node_subjects_any(p, op),
            None => engram_access::perms::routed_subjects_any(op),
        };
        // Each op twice: the agents' form, checked as an agent's request; and the admin's
        // and the services' (no agent's key reaches it), trusted as on `engram.q.<op>`.
        macro_rules! routed {
            ($op:literal, $req:ty, |$q:ident, $r:ident| $body:expr) => {{
                for subject in subjects($op) {
                    let q = self.clone();
                    engram_rpc::serve_from_with(
                        service,
                        &routes($op),
                        &subject,
                        $op,
                        limits,
                        move |subject: &str, $r: $req| {
                            let $q = q.clone();
                            let subject = subject.to_owned();
                            async move {
                                let agent = $q.check_routed(&subject, partition, &$r)?;
                                if agent {
                                    $q.authorize(&subject, &$r).await?;
                                }
                                $body
                            }
                        },
                    )
                    .await?;
                }
            }};
        }
        routed!("retrieve", RetrieveRequest, |q, r| q
            .retrieve_counted(r)
            .await);
        routed!("context", ContextRequest, |q, r| q.build_context(r).await);
        routed!("facts", FactsRequest, |q, r| q.facts(r).await);
        routed!("skills", SkillsRequest, |q, r| q.skills(r).await);
        routed!("doc", DocRequest, |q, r| q.doc(r).await);
        Ok(())
    }

    /// A routed request's subject against its body and the partition it was served for:
    /// the subject's scope must be the request's own, and on `engram.n.<partition>` that
    /// scope must be of `partition`. An agent's key may publish to any partition's routed
    /// subjects (permissions are checked after the mapping, on `engram.n.*`), so a request
    /// that names a partition its scope is not in reached this node on a path the mapping
    /// never makes: refused, not answered from the wrong node.
    /// Returns whether it is an agent's (to be checked as one) rather than privileged.
    fn check_routed<R: access::Scoped>(
        &self,
        subject: &str,
        partition: Option<u32>,
        request: &R,
    ) -> Result<bool, Failure> {
        let routed = engram_access::perms::routed_of(subject).ok_or_else(|| {
            Failure::new(
                ErrorCode::Forbidden,
                format!("{subject} is not a routed query subject"),
            )
        })?;
        if let Some(p) = partition {
            let holds = routed.partition == Some(p)
                && ScopeKey::new(routed.tenant.clone(), routed.scope.clone())
                    .partition(self.partitions())
                    == p;
            if !holds {
                return Err(Failure::new(
                    ErrorCode::Forbidden,
                    format!(
                        "{subject}: scope {} of tenant {} is not in partition {p}; send queries to engram.q.<tenant>.<agent>.<op>.<kind>.<id> and the server routes them",
                        routed.scope, routed.tenant
                    ),
                ));
            }
        }
        let own = request.scope_request();
        // An agent's tenant is the subject's, checked against the body by the access check
        // that follows (a body naming another tenant is forbidden); the privileged form's
        // subject must name the body's.
        let other_tenant = routed.agent.is_none() && own.tenant != routed.tenant;
        if own.scope != routed.scope || other_tenant {
            return Err(Failure::invalid(format!(
                "the subject names scope {} of tenant {} but the request's own scope is {} of tenant {}; send it to the subject of its own scope",
                routed.scope, routed.tenant, own.scope, own.tenant
            )));
        }
        Ok(routed.agent.is_some())
    }

    /// Hybrid retrieval, with the memories returned counted for the usage events.
    async fn retrieve_counted(
        &self,
        request: RetrieveRequest,
    ) -> Result<RetrieveResponse, Failure> {
        let response = self.retrieve(request).await?;
        let returned = response.results.iter().chain(&response.summaries);
        self.usage.count(returned.map(|m| {
            (
                ScopeKey::new(m.tenant.clone(), m.scope.clone()),
                &m.event_id,
            )
        }));
        Ok(response)
    }

    /// Checks the access registry when an agent reads its own memory: the body must name the
    /// caller's tenant, and every scope read must be the caller's or granted to it. Used by
    /// a service run with `--insecure-no-auth` too, where only the tenant check applies.
    pub async fn authorize<R: access::Scoped>(
        &self,
        subject: &str,
        request: &R,
    ) -> Result<(), Failure> {
        match self.access.get() {
            Some(guard) => guard.authorize(subject, request.scope_request()).await,
            None => access::authenticated_tenant(subject, request.scope_request()).map(|_| ()),
        }
    }

    /// Where the snapshot index is, when not the default buckets.
    pub fn set_snapshots(&self, config: engram_snapshots::SnapshotsConfig) {
        let _ = self.snapshots_config.set(config);
    }

    /// The read models hosted in this process: requests to their partitions are answered in
    /// process, without NATS.
    pub fn set_local(&self, local: engram_rpc::LocalRoutes) {
        let _ = self.local.set(local);
    }

    /// Turns the access checks on: from now on agent requests are checked against `guard`.
    pub fn set_access(&self, guard: access::Guard) {
        let _ = self.access.set(guard);
    }

    /// Refuses a `wait_ms` beyond the protocol's bound and a `min_seq` that no append can
    /// have returned, which would otherwise wait out its whole wait for nothing.
    pub(crate) async fn check_visible_token(
        &self,
        consistency: &Consistency,
    ) -> Result<(), Failure> {
        consistency.validate().map_err(Failure::from)?;
        engram_rpc::check_min_seq(&self.head, consistency).await
    }

    fn timeout(&self, wait_ms: Option<u64>) -> Duration {
        self.config.projector_timeout
            + wait_ms.map_or(Duration::from_secs(5), Duration::from_millis)
    }

    async fn search(
        &self,
        projector: &'static str,
        request: &SearchRequest,
    ) -> Result<SearchResponse, Failure> {
        let started = std::time::Instant::now();
        // Each partition gets the request with its own scopes: the best `k` of each hold
        // the best `k` of all.
        let asks = self.split(&request.scopes).into_iter().map(|(p, scopes)| {
            (
                p,
                SearchRequest {
                    scopes,
                    ..request.clone()
                },
            )
        });
        let answer = self
            .ask(
                projector,
                read_models::SEARCH_OP,
                asks,
                self.timeout(request.consistency.wait_ms),
            )
            .await
            .map(|parts| route::merge_search(parts, request.k));
        metrics::RETRIEVE_STAGE_SECONDS
            .with_label_values(&[projector])
            .observe(started.elapsed().as_secs_f64());
        answer
    }

    /// Hybrid retrieval. See [`RetrieveRequest`].
    pub async fn retrieve(&self, request: RetrieveRequest) -> Result<RetrieveResponse, Failure> {
        let scopes = request.scopes.resolve().map_err(Failure::invalid)?;
        request
            .validate(self.config.max_top_k)
            .map_err(Failure::from)?;
        let checking = std::time::Instant::now();
        self.check_visible_token(&request.consistency).await?;
        metrics::RETRIEVE_STAGE_SECONDS
            .with_label_values(&["token"])
            .observe(checking.elapsed().as_secs_f64());
        let ranking = request
            .ranking
            .clone()
            .unwrap_or_else(|| self.config.ranking.clone());
        let depth = ranking.depth(request.top_k);
        let search = SearchRequest {
            scopes,
            query: request.query.clone(),
            vector: request.vector.clone(),
            k: depth,
            filter: request.filter.clone(),
            consistency: request.consistency,
            score_also: Vec::new(),
            rest: 0,
        };
        let now = chrono::Utc::now();
        let dates = if ranking.date_weight > 0.0 {
            when::Mentions::parse(&request.query, now)
        } else {
            when::Mentions::default()
        };
        if !dates.is_empty() {
            metrics::RETRIEVE_DATED.inc();
            tracing::debug!(dates = ?dates.0, "query names dates");
        }
        let (mut dense, mut keyword) = (Side::default(), Side::default());
        let mut visible = Vec::new();
        match request.mode {
            RetrievalMode::Dense => {
                let r = self.search(read_models::VECTOR, &search).await?;
                visible.push((read_models::VECTOR.to_owned(), r.visible_seq));
                dense.hits = r.hits;
            }
            RetrievalMode::Keyword => {
                let r = self.search(read_models::KEYWORD, &search).await?;
                visible.push((read_models::KEYWORD.to_owned(), r.visible_seq));
                keyword.hits = r.hits;
            }
            RetrievalMode::Hybrid if ranking.fusion == proto::Fusion::Score => {
                // Score fusion compares both retrievers on every candidate of either list.
                // Keyword first: its answer also carries the BM25 scores of the memories
                // ranked after its hits (down to `rest`), which covers the dense-only
                // candidates; then the vector side searches and scores the keyword hits in
                // the same request. Two projector requests instead of two rounds of two.
                let k = self
                    .search(
                        read_models::KEYWORD,
                        &SearchRequest {
                            rest: rescore_depth(depth),
                            ..search.clone()
                        },
                    )
                    .await?;
                let d = self
                    .search(
                        read_models::VECTOR,
                        &SearchRequest {
                            score_also: k.hits.iter().map(|h| h.hit.seq).collect(),
                            ..search.clone()
                        },
                    )
                    .await?;
                visible.push((read_models::VECTOR.to_owned(), d.visible_seq));
                visible.push((read_models::KEYWORD.to_owned(), k.visible_seq));
                // Fusion takes an `also` score only for a candidate the side did not rank,
                // so the lists need no trimming.
                dense = Side {
                    hits: d.hits,
                    also: d.also,
                };
                keyword = Side {
                    hits: k.hits,
                    also: k.also,
                };
            }
            RetrievalMode::Hybrid => {
                let (d, k) = tokio::join!(
                    self.search(read_models::VECTOR, &search),
                    self.search(read_models::KEYWORD, &search)
                );
                let (d, k) = (d?, k?);
                visible.push((read_models::VECTOR.to_owned(), d.visible_seq));
                visible.push((read_models::KEYWORD.to_owned(), k.visible_seq));
                dense.hits = d.hits;
                keyword.hits = k.hits;
            }
        }
        let fusing = std::time::Instant::now();
        // A filter that asks for summaries gets them as results.
        let asks_for_summaries = request
            .filter
            .kinds
            .contains(&engram_schema::EventKind::Consolidated)
            || request
                .filter
                .tags
                .iter()
                .any(|t| t == engram_memory::SUMMARY_TAG);
        let fusion::Fused { results, summaries } = fusion::fuse_with(
            &dense,
            &keyword,
            &ranking,
            &dates,
            now,
            request.top_k,
            ranking.summary_results || asks_for_summaries,
        );
        metrics::RETRIEVE_STAGE_SECONDS
            .with_label_values(&["fuse"])
            .observe(fusing.elapsed().as_secs_f64());
        Ok(RetrieveResponse {
            results,
            summaries,
            visible,
        })
    }

    /// A request answered by one read model: its scopes and fields checked here first, its
    /// read-your-writes token refused at once if no append returned it, then forwarded to
    /// `engram.p.<model>.<op>.<partition>` of every partition holding one of its scopes
    /// (each instance answers the scopes it holds), or only the own scope's with
    /// `own_only`; `merge` makes one answer of theirs, given the request's scopes.
    async fn forward<Req, Resp>(
        &self,
        scopes: &proto::ScopeRequest,
        request: &Req,
        (model, op): (&str, &str),
        own_only: bool,
        extra: Duration,
        merge: impl FnOnce(&[ScopeKey], Vec<Resp>) -> Result<Resp, Failure>,
    ) -> Result<Resp, Failure>
    where
        Req: Serialize + proto::ProjectorRequest + Clone + Send + 'static,
        Resp: serde::de::DeserializeOwned + Send + 'static,
    {
        let keys = scopes.resolve().map_err(Failure::invalid)?;
        request.validate().map_err(Failure::from)?;
        let consistency = request.consistency();
        self.check_visible_token(&consistency).await?;
        let held = if own_only { &keys[..1] } else { &keys[..] };
        let partitions = self
            .split(held)
            .into_iter()
            .map(|(p, _)| (p, request.clone()));
        let parts = self
            .ask(
                model,
                op,
                partitions,
                self.timeout(consistency.wait_ms) + extra,
            )
            .await?;
        merge(&keys, parts)
    }

    /// Facts, through the fact projector.
    pub async fn facts(&self, request: FactsRequest) -> Result<FactsResponse, Failure> {
        let scopes = request.scopes.clone();
        let limit = request.limit;
        self.forward(
            &scopes,
            &request,
            (read_models::FACTS, read_models::QUERY_OP),
            false,
            Duration::ZERO,
            |keys, parts: Vec<FactsResponse>| {
                let visible_seq = route::least_visible(parts.iter().map(|p| p.visible_seq));
                let facts = parts.into_iter().flat_map(|p| p.facts).collect();
                Ok(FactsResponse {
                    facts: route::in_scope_order(facts, |f| route::scope_place(keys, f), limit),
                    visible_seq,
                })
            },
        )
        .await
    }

    /// Skills, through the skill projector.
    pub async fn skills(&self, request: SkillsRequest) -> Result<SkillsResponse, Failure> {
        let scopes = request.scopes.clone();
        let (limit, by_name) = (request.limit, request.name.is_some());
        self.forward(
            &scopes,
            &request,
            (read_models::SKILLS, read_models::SEARCH_OP),
            false,
            Duration::ZERO,
            |keys, parts: Vec<SkillsResponse>| {
                let visible_seq = route::least_visible(parts.iter().map(|p| p.visible_seq));
                let mut skills: Vec<serde_json::Value> =
                    parts.into_iter().flat_map(|p| p.skills).collect();
                let skills = if by_name {
                    route::in_scope_order(skills, |s| route::scope_place(keys, s), limit)
                } else {
                    // Ranked over every scope by score: a stable sort keeps each
                    // partition's order among equals.
                    let score = |s: &serde_json::Value| s["score"].as_f64().unwrap_or(0.0);
                    skills.sort_by(|a, b| score(b).total_cmp(&score(a)));
                    skills.truncate(limit);
                    skills
                };
                Ok(SkillsResponse {
                    skills,
                    visible_seq,
                })
            },
        )
        .await
    }

    /// Who the agent of `subject` is, as the registry holds it. Without authentication,
    /// the subject's tenant and agent, with the default scopes and no public keys (there is
    /// no registry to list them).
    pub async fn whoami(&self, subject: &str) -> Result<proto::WhoamiResponse, Failure> {
        match self.access.get() {
            Some(guard) => guard.whoami(subject).await,
            None => {
                let (tenant, agent) = access::caller(subject)?;
                Ok(proto::WhoamiResponse {
                    scopes: engram_access::perms::ScopePattern::defaults(&agent)
                        .iter()
                        .map(ToString::to_string)
                        .collect(),
                    grants: Vec::new(),
                    public_keys: None,
                    tenant,
                    agent,
                })
            }
        }
    }

    /// `items` the caller may read: all for the admin (`who` is `None`), else those of
    /// scopes the agent may read.
    async fn readable<T>(
        &self,
        who: Option<&str>,
        tenant: &Ident,
        items: Vec<T>,
        scope_of: impl Fn(&T) -> Option<Scope>,
    ) -> Result<Vec<T>, Failure> {
        let Some(subject) = who else {
            return Ok(items);
        };
        match self.access.get() {
            Some(guard) => guard.readable(subject, tenant, items, scope_of).await,
            None => {
                let (own, _) = access::caller(subject)?;
                access::check_tenant(&own, tenant)?;
                Ok(items)
            }
        }
    }

    /// The scopes of a tenant that hold events, from the stream's per-subject counts (one
    /// stream-info listing, bounded).
    pub async fn scopes(
        &self,
        request: proto::ScopesRequest,
        who: Option<&str>,
    ) -> Result<proto::ScopesResponse, Failure> {
        request.validate().map_err(Failure::from)?;
        let filter = format!("{}.{}.>", engram_schema::SUBJECT_PREFIX, request.tenant);
        let (subjects, mut truncated) = self
            .bus
            .subject_counts(&filter, MAX_LISTED_SUBJECTS)
            .await
            .map_err(|e| Failure::new(ErrorCode::Unavailable, e.to_string()))?;
        let mut by_scope: std::collections::BTreeMap<String, proto::ScopeCount> =
            Default::default();
        for (subject, n) in subjects {
            let Some((_, scope, layer)) = engram_schema::parse_subject(&subject) else {
                continue;
            };
            let entry = by_scope
                .entry(scope.to_string())
                .or_insert_with(|| proto::ScopeCount {
                    scope,
                    events: 0,
                    layers: Default::default(),
                });
            entry.events += n;
            *entry.layers.entry(layer.to_string()).or_default() += n;
        }
        let mut scopes = self
            .readable(
                who,
                &request.tenant,
                by_scope.into_values().collect(),
                |c| Some(c.scope.clone()),
            )
            .await?;
        if scopes.len() > request.limit {
            scopes.truncate(request.limit);
            truncated = true;
        }
        Ok(proto::ScopesResponse { scopes, truncated })
    }

    /// The snapshot index, metadata only.
    pub async fn snapshots(
        &self,
        request: proto::SnapshotsRequest,
    ) -> Result<proto::SnapshotsResponse, Failure> {
        let store = self
            .snapshots
            .get_or_try_init(|| {
                engram_snapshots::SnapshotStore::open(
                    &self.bus,
                    self.snapshots_config.get().cloned().unwrap_or_default(),
                )
            })
            .await
            .map_err(|e| Failure::new(ErrorCode::Unavailable, e.to_string()))?;
        let list = store
            .list(request.projector.as_ref().map(Ident::as_str))
            .await
            .map_err(|e| Failure::new(ErrorCode::Unavailable, e.to_string()))?;
        Ok(proto::SnapshotsResponse {
            snapshots: list
                .iter()
                .filter_map(|m| serde_json::to_value(m).ok())
                .collect(),
        })
    }

    /// The newest dead letters of a tenant's (readable) scopes: their headers are listed,
    /// and only the letters returned are read whole.
    pub async fn dead_letters(
        &self,
        request: proto::DeadLettersRequest,
        who: Option<&str>,
    ) -> Result<proto::DeadLettersResponse, Failure> {
        request.validate().map_err(Failure::from)?;
        let unavailable =
            |e: engram_bus::dlq::DlqError| Failure::new(ErrorCode::Unavailable, e.to_string());
        let prefix = format!("{}.{}.", engram_schema::SUBJECT_PREFIX, request.tenant);
        // The newest letters only: anyone who can append can make poison events, so a
        // listing must not cost the whole dead-letter stream.
        let last = match self.bus.dead_letters_last_seq().await {
            Ok(last) => last,
            Err(engram_bus::dlq::DlqError::StreamMissing) => 0,
            Err(e) => return Err(unavailable(e)),
        };
        let after = last.saturating_sub(MAX_SCANNED_DEAD_LETTERS);
        let refs = match self.bus.dead_letter_refs(after).await {
            Ok(refs) => refs,
            // No projector has dead-lettered anything yet.
            Err(engram_bus::dlq::DlqError::StreamMissing) => Vec::new(),
            Err(e) => return Err(unavailable(e)),
        };
        let refs: Vec<_> = refs
            .into_iter()
            .filter(|r| r.subject.as_deref().is_some_and(|s| s.starts_with(&prefix)))
            .collect();
        let mut refs = self
            .readable(who, &request.tenant, refs, |r| {
                r.subject.as_deref().and_then(scope_of_subject)
            })
            .await?;
        let total = refs.len() as u64;
        refs.reverse();
        refs.truncate(request.limit);
        let codec = self.bus.codec();
        let mut dead_letters = Vec::with_capacity(refs.len());
        for r in refs {
            let letter = match self.bus.dead_letter_at(r.dlq_seq).await {
                Ok(letter) => letter,
                // Erased or aged out since the listing.
                Err(engram_bus::dlq::DlqError::NotFound { .. }) => continue,
                Err(e) => return Err(unavailable(e)),
            };
            let event = letter.decode(codec).ok();
            let subject = r.subject.unwrap_or_default();
            dead_letters.push(proto::DeadLetterInfo {
                dlq_seq: r.dlq_seq,
                projector: r.projector,
                event_seq: r.event_seq,
                scope: scope_of_subject(&subject),
                subject,
                reason: letter.reason,
                stored_at: letter.stored_at,
                event_id: event.as_ref().map(|e| e.event_id.to_string()),
                kind: event.as_ref().map(|e| e.kind.to_string()),
                text: event.map(|e| {
                    e.content
                        .text
                        .chars()
                        .take(DEAD_LETTER_TEXT_CHARS)
                        .collect()
                }),
            });
        }
        Ok(proto::DeadLettersResponse {
            dead_letters,
            total,
        })
    }

    /// The consolidation plan of one scope, through the consolidator.
    pub async fn consolidate(
        &self,
        request: ConsolidateRequest,
    ) -> Result<ConsolidateResponse, Failure> {
        let scopes = request.scopes.clone();
        self.forward(
            &scopes,
            &request,
            (read_models::CONSOLIDATOR, read_models::PLAN_OP),
            true,
            Duration::ZERO,
            |_, parts: Vec<ConsolidateResponse>| one(parts),
        )
        .await
    }

    /// A scope's slice of a read model's snapshot, through that model's projector. Loading a
    /// snapshot takes longer than a query: a minute more.
    pub async fn bootstrap(&self, request: BootstrapRequest) -> Result<BootstrapResponse, Failure> {
        let scopes = request.scopes.clone();
        let model = request.model.clone();
        let partitions = self.partitions();
        self.forward(
            &scopes,
            &request,
            (model.as_str(), "bootstrap"),
            false,
            Duration::from_secs(60),
            |keys, parts| slices::merge(partitions, keys, parts),
        )
        .await
    }

    /// Cuts a snapshot of every read model, through each projector's snapshot endpoint, one
    /// model after another (each projector cuts one at a time, and returns its newest
    /// snapshot rather than a copy when nothing was applied since).
    pub async fn snapshot(
        &self,
        request: proto::SnapshotCutRequest,
    ) -> Result<proto::SnapshotCutResponse, Failure> {
        request.scopes.resolve().map_err(Failure::invalid)?;
        request.validate().map_err(Failure::from)?;
        // Held for the whole cut: a second request waits for the first, then finds it.
        let mut last = self.last_cut.lock().await;
        if let Some((at, answer)) = last.as_ref() {
            let since = at.elapsed();
            if since < self.config.snapshot_min_interval {
                if request.label.is_none() {
                    return Ok(answer.clone());
                }
                let wait = self.config.snapshot_min_interval - since;
                return Err(Failure::new(
                    ErrorCode::Busy,
                    format!(
                        "a snapshot was cut {}s ago; a labelled one can be cut in {}s (query.snapshot_min_interval)",
                        since.as_secs(),
                        wait.as_secs() + 1
                    ),
                ));
            }
        }
        let mut response = proto::SnapshotCutResponse {
            snapshots: Vec::new(),
            skipped: Vec::new(),
        };
        let body = serde_json::json!({ "label": request.label });
        for model in read_models::ALL {
            // Every partition's instance cuts its own snapshot, all at once.
            let cuts = (0..self.partitions()).map(|p| {
                let subject = proto::partition_subject(model, "snapshot", p);
                let body = &body;
                async move {
                    let cut: Result<serde_json::Value, _> =
                        engram_rpc::call(&self.client, &subject, body, Duration::from_secs(600))
                            .await;
                    (p, cut)
                }
            });
            for (p, cut) in futures::future::join_all(cuts).await {
                match cut {
                    Ok(meta) => response.snapshots.push(meta),
                    // A model that cannot export itself, or one not running here.
                    Err(e) => response.skipped.push(format!("{model} partition {p}: {e}")),
                }
            }
        }
        *last = Some((std::time::Instant::now(), response.clone()));
        Ok(response)
    }

    /// A shared document, or the documents of the readable scopes, through the document
    /// projector.
    pub async fn doc(&self, request: DocRequest) -> Result<DocResponse, Failure> {
        let scopes = request.scopes.clone();
        // One document is of the own scope; a list is of every readable scope.
        let (list, limit) = (request.read == proto::DocRead::List, request.limit);
        self.forward(
            &scopes,
            &request,
            (read_models::DOCS, read_models::GET_OP),
            !list,
            Duration::ZERO,
            |keys, parts: Vec<DocResponse>| {
                if !list {
                    return one(parts);
                }
                let visible_seq = route::least_visible(parts.iter().map(|p| p.visible_seq));
                let docs = parts.into_iter().flat_map(|p| p.docs).collect();
                let place = |d: &proto::DocSummary| {
                    keys.iter()
                        .position(|k| k.kind == d.scope.kind && k.id == d.scope.id)
                };
                Ok(DocResponse {
                    docs: route::in_scope_order(docs, place, limit),
                    doc: None,
                    conflicts: Vec::new(),
                    truncated: false,
                    bytes: None,
                    history: Vec::new(),
                    visible_seq,
                })
            },
        )
        .await
    }

    /// Working memory of one scope: put, get, delete or list.
    pub async fn working(
        &self,
        request: proto::WorkingRequest,
    ) -> Result<proto::WorkingResponse, Failure> {
        request.scopes.resolve().map_err(Failure::invalid)?;
        request.validate().map_err(Failure::from)?;
        let wm = self.bus.working_memory().await.map_err(unavailable)?;
        let (tenant, scope) = (&request.scopes.tenant, &request.scopes.scope);
        let key = request.key.as_deref().unwrap_or_default();
        let bad = |e: engram_bus::BusError| match e {
            engram_bus::BusError::Schema(e) => Failure::invalid(e.to_string()),
            e => unavailable(e),
        };
        let mut response = proto::WorkingResponse {
            entries: Vec::new(),
            left_out: 0,
            revision: None,
        };
        match request.op {
            proto::WorkingOp::Put => {
                let value = request.value.clone().unwrap_or_default();
                let ttl = request.ttl_ms.map(Duration::from_millis);
                response.revision = Some(
                    wm.put(tenant, scope, key, value.into_bytes().into(), ttl)
                        .await
                        .map_err(bad)?,
                );
            }
            proto::WorkingOp::Get => {
                if let Some(v) = wm.get(tenant, scope, key).await.map_err(bad)? {
                    response.entries.push(proto::WorkingEntry {
                        key: key.to_owned(),
                        value: String::from_utf8_lossy(&v).into_owned(),
                    });
                }
            }
            proto::WorkingOp::Delete => wm.delete(tenant, scope, key).await.map_err(bad)?,
            proto::WorkingOp::List => {
                let entries = wm
                    .entries(tenant, scope, engram_bus::working::EntryBounds::default())
                    .await
                    .map_err(bad)?;
                response.left_out = entries.left_out;
                response.entries = entries
                    .items
                    .into_iter()
                    .map(|(key, v)| proto::WorkingEntry {
                        key,
                        value: String::from_utf8_lossy(&v).into_owned(),
                    })
                    .collect();
            }
        }
        Ok(response)
    }

    /// One page of the events of the request's scopes after `after_seq`, in stream order,
    /// read without a consumer ([`replay`]). Within the tenant's share of replay pages:
    /// [`Query::replay_as`] is the agent's path, which holds the agent to its own share too.
    pub async fn replay(
        &self,
        request: proto::ReplayRequest,
    ) -> Result<proto::ReplayResponse, Failure> {
        self.replay_for(None, request).await
    }

    /// [`Query::replay`] for the agent whose subject (`engram.q.<tenant>.<agent>.replay`)
    /// the request arrived on: within that agent's share and its tenant's.
    pub async fn replay_as(
        &self,
        subject: &str,
        request: proto::ReplayRequest,
    ) -> Result<proto::ReplayResponse, Failure> {
        let caller = engram_access::perms::caller_of(subject);
        self.replay_for(caller, request).await
    }

    async fn replay_for(
        &self,
        caller: Option<(Ident, Ident)>,
        request: proto::ReplayRequest,
    ) -> Result<proto::ReplayResponse, Failure> {
        let keys = request.scopes.resolve().map_err(Failure::invalid)?;
        request.validate().map_err(Failure::from)?;
        // An agent's requests are checked to name its own tenant before they get here.
        let (tenant, agent) = match &caller {
            Some((tenant, agent)) => (tenant, Some(agent)),
            None => (&request.scopes.tenant, None),
        };
        let _share = self.replay_shares.take(tenant, agent)?;
        replay::page(&self.bus, &keys, request.after_seq, request.limit).await
    }

    /// Assembles working, episodic, semantic and procedural memory for one agent step.
    pub async fn build_context(&self, request: ContextRequest) -> Result<Context, Failure> {
        context::build(self, request).await
    }

    pub(crate) fn tokens(&self) -> &Arc<TokenCounter> {
        &self.tokens
    }

    pub(crate) fn bus(&self) -> &Bus {
        &self.bus
    }

    pub(crate) fn usage(&self) -> &usage::Usage {
        &self.usage
    }
}

/// The ops a query about one scope is routed for, to the memory node owning the scope.
const ROUTED_OPS: [&str; 5] = ["retrieve", "context", "facts", "skills", "doc"];

/// How deep the keyword side ranks to give BM25 scores of dense-only candidates: memories
/// beyond it score as absent, which is what they are to BM25.
fn rescore_depth(depth: usize) -> usize {
    depth.saturating_mul(4).max(200)
}

pub(crate) fn unavailable(e: impl std::fmt::Display) -> Failure {
    Failure::new(ErrorCode::Unavailable, e.to_string())
}

/// The answer of the only partition asked.
fn one<T>(parts: Vec<T>) -> Result<T, Failure> {
    parts
        .into_iter()
        .next()
        .ok_or_else(|| Failure::new(ErrorCode::Internal, "no partition was asked"))
}
