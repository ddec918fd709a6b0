//! The Rust SDK that agents use to write to and read from Engram.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use engram_sdk::{Client, EventKind, Layer, Scope, ScopeKind};
//! let client = Client::connect("nats://127.0.0.1:4222").await?;
//! let agent = client.agent("acme", "planner", "i-1")?;
//! let task = Scope::new(ScopeKind::Task, "fix-login-bug")?;
//! let receipt = agent
//!     .event(task, Layer::Episodic, EventKind::Observation, "login fails with a 500")
//!     .tag("auth")
//!     .importance(0.7)
//!     .append()
//!     .await?;
//! println!("stored at seq {}", receipt.seq); // the read-your-writes token
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - [`Client`]: a connection; appends retry retryable failures with the *same* event id,
//!   which the stream deduplicates, so a retry never stores twice.
//! - [`Agent`]: a client bound to one tenant, agent and instance, which stamps events.
//! - [`EventBuilder`]: fills in an envelope field by field.
//! - [`bootstrap`]: a new instance's memory of its scopes, from snapshots and the tail.
//! - [`doc`]: shared documents: a writer's copy ([`doc::SharedDoc`]) that edits offline and
//!   pushes its changes, and the typed task board, profile and scratchpad.
//! - [`usage`]: [`UsageReporter`], which aggregates the memories each step used into one
//!   `feedback` event per scope per interval.

pub mod bootstrap;
pub mod doc;
pub mod erase;
pub mod usage;

use std::time::Duration;

use chrono::{DateTime, Utc};
pub use engram_bus::{
    AppendError, AppendOptions, AppendReceipt, Bus, BusConfig, BusError, EventStream, ReadError,
    StartAt, StoredEvent, WorkingMemory,
};
pub use engram_memory::MemoryFilter;
pub use engram_memory::proto::{
    self, Consistency, Context, ContextItem, ContextRequest, DocConflict, DocRead, DocRequest,
    DocResponse, DocSummary, ErrorCode, FactsRequest, FactsResponse, MemoryResult, Ranking,
    RetrievalMode, RetrieveRequest, RetrieveResponse, ScopeRequest, SkillsRequest, SkillsResponse,
};
pub use engram_rpc::RpcError;
pub use engram_schema::{
    Content, Embedding, Envelope, EventId, EventKind, Ident, Layer, SchemaError, Scope, ScopeKind,
    SubjectFilter,
};
pub use usage::UsageReporter;

/// How appends retry when the server does not acknowledge, and queries when it answers
/// `busy`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Give up after this long and return the last error.
    pub max_elapsed: Duration,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Whether a query answered `busy` is asked again (with backoff, within `max_elapsed`).
    /// Off, the caller gets [`ErrorCode::Busy`] at once: for a caller with its own policy,
    /// or one that measures refusals (the load test does).
    pub retry_busy: bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_elapsed: Duration::from_secs(30),
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            retry_busy: true,
        }
    }
}

impl RetryPolicy {
    /// No retries: the first failure is returned.
    pub fn none() -> Self {
        Self {
            max_elapsed: Duration::ZERO,
            ..Self::default()
        }
    }
}

/// A connection to Engram.
#[derive(Clone, Debug)]
pub struct Client {
    bus: Bus,
    retry: RetryPolicy,
    /// Redacts secrets from every event before it is appended (the default policy unless
    /// [`Client::with_scrub`] sets another).
    scrubbers: engram_scrub::Scrubbers,
}

impl Client {
    /// Connects with default settings. The events stream must already exist (`engram up`
    /// creates it); use [`Client::with_config`] with `provision = true` to create it.
    pub async fn connect(url: &str) -> Result<Self, BusError> {
        Self::with_config(
            BusConfig {
                url: url.to_owned(),
                ..BusConfig::default()
            },
            RetryPolicy::default(),
            false,
        )
        .await
    }

    /// Connects as the identity in a credentials file (from `engram agent add`). An agent's
    /// client sends its queries to `engram.q.<tenant>.<agent>.*`, the only query subjects
    /// its key may use; the server refuses the connection if the key was revoked.
    pub async fn connect_with_creds(
        url: &str,
        creds: &std::path::Path,
    ) -> Result<Self, engram_access::AccessError> {
        let creds = engram_access::Credentials::load(creds)?;
        Self::with_config(
            BusConfig {
                url: url.to_owned(),
                nkey: Some(engram_bus::NkeyAuth::of(&creds)),
                ..BusConfig::default()
            },
            RetryPolicy::default(),
            false,
        )
        .await
        .map_err(|e| engram_access::AccessError::Invalid(e.to_string()))
    }

    /// The tenant and agent this client is authenticated as, if it holds agent credentials.
    pub fn agent_identity(&self) -> Option<&(Ident, Ident)> {
        self.bus
            .config()
            .nkey
            .as_ref()
            .and_then(|n| n.agent.as_ref())
    }

    /// Connects with explicit settings; `provision` creates the stream and bucket if missing.
    pub async fn with_config(
        config: BusConfig,
        retry: RetryPolicy,
        provision: bool,
    ) -> Result<Self, BusError> {
        let bus = Bus::connect(config).await?;
        if provision {
            bus.provision().await?;
        }
        Ok(Self::from_bus(bus, retry))
    }

    /// Wraps an existing bus.
    pub fn from_bus(bus: Bus, retry: RetryPolicy) -> Self {
        Self {
            bus,
            retry,
            scrubbers: engram_scrub::Scrubbers::default(),
        }
    }

    /// This client with secrets redacted by `config` (`[scrub]`) instead of the default
    /// policy.
    pub fn with_scrub(mut self, config: &engram_scrub::ScrubConfig) -> Self {
        self.scrubbers = engram_scrub::Scrubbers::new(config);
        self
    }

    /// The secret scrubbers this client redacts with.
    pub fn scrubbers(&self) -> &engram_scrub::Scrubbers {
        &self.scrubbers
    }

    /// Redacts the secrets in `value` by `tenant`'s policy, counted: for what reaches the
    /// stream other than as an event's text or data, such as a document field
    /// (`engram doc edit --set`). Returns how many were redacted.
    pub fn scrub_value(&self, tenant: &str, value: &mut serde_json::Value) -> usize {
        let kinds = engram_scrub::scrub_json(self.scrubbers.for_tenant(tenant), value);
        for kind in &kinds {
            engram_telemetry::metrics::SCRUB_REDACTIONS
                .with_label_values(&[kind.as_str(), "sdk"])
                .inc();
        }
        kinds.len()
    }

    /// `event` as it may be persisted: with its secrets redacted, counted.
    fn scrubbed<'a>(&self, event: &'a Envelope) -> std::borrow::Cow<'a, Envelope> {
        match self.scrubbers.scrubbed(event) {
            None => std::borrow::Cow::Borrowed(event),
            Some((clean, kinds)) => {
                for kind in &kinds {
                    engram_telemetry::metrics::SCRUB_REDACTIONS
                        .with_label_values(&[kind.as_str(), "sdk"])
                        .inc();
                }
                tracing::debug!(event_id = %event.event_id, redactions = kinds.len(), "secrets redacted before append");
                std::borrow::Cow::Owned(clean)
            }
        }
    }

    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// A handle that stamps events with this tenant, agent and instance.
    pub fn agent(
        &self,
        tenant: &str,
        agent_id: &str,
        instance_id: &str,
    ) -> Result<Agent, SchemaError> {
        Ok(Agent {
            client: self.clone(),
            tenant: Ident::parse("tenant", tenant)?,
            agent_id: Ident::parse("agent_id", agent_id)?,
            instance_id: Ident::parse("instance_id", instance_id)?,
        })
    }

    /// Appends one event, retrying retryable failures with the same event id.
    pub async fn append(&self, event: &Envelope) -> Result<AppendReceipt, AppendError> {
        self.append_with(event, AppendOptions::default()).await
    }

    /// Appends with options (optimistic concurrency, trace context), retrying as [`Client::append`].
    pub async fn append_with(
        &self,
        event: &Envelope,
        opts: AppendOptions,
    ) -> Result<AppendReceipt, AppendError> {
        let event = &*self.scrubbed(event);
        let started = tokio::time::Instant::now();
        let mut backoff = self.retry.initial_backoff;
        let mut attempt = 1u32;
        loop {
            let result = if self.agent_identity().is_some() {
                self.append_through_service(std::slice::from_ref(event), opts)
                    .await
                    .pop()
                    .expect("one result per event")
            } else {
                self.bus.append(event, opts).await
            };
            match result {
                Err(e)
                    if e.is_retryable() && started.elapsed() + backoff < self.retry.max_elapsed =>
                {
                    tracing::debug!(attempt, event_id = %event.event_id, error = %e, "append will be retried");
                    tokio::time::sleep(jitter(backoff)).await;
                    backoff = (backoff * 2).min(self.retry.max_backoff);
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Appends many events with pipelined acks, then retries the retryable failures (by the
    /// same ids) until they succeed or the retry budget runs out. Results are in input order.
    pub async fn append_batch(
        &self,
        events: &[Envelope],
    ) -> Vec<Result<AppendReceipt, AppendError>> {
        let scrubbed: Vec<std::borrow::Cow<'_, Envelope>> =
            events.iter().map(|e| self.scrubbed(e)).collect();
        let events: Vec<Envelope> = scrubbed.into_iter().map(|e| e.into_owned()).collect();
        let events = &events[..];
        let inflight = self.bus.config().max_inflight;
        let mut results = self.append_batch_once(events, inflight).await;
        let started = tokio::time::Instant::now();
        let mut backoff = self.retry.initial_backoff;
        loop {
            let retry: Vec<usize> = results
                .iter()
                .enumerate()
                .filter(|(_, r)| matches!(r, Err(e) if e.is_retryable()))
                .map(|(i, _)| i)
                .collect();
            if retry.is_empty() || started.elapsed() + backoff >= self.retry.max_elapsed {
                return results;
            }
            tokio::time::sleep(jitter(backoff)).await;
            backoff = (backoff * 2).min(self.retry.max_backoff);
            let again: Vec<Envelope> = retry.iter().map(|&i| events[i].clone()).collect();
            for (i, r) in retry
                .into_iter()
                .zip(self.append_batch_once(&again, inflight).await)
            {
                results[i] = r;
            }
        }
    }

    /// One try of a batch: straight to the stream, or, for an agent, through the query
    /// service in requests of at most [`proto::limits::MAX_APPEND_EVENTS`] events that fit
    /// the server's payload limit.
    async fn append_batch_once(
        &self,
        events: &[Envelope],
        inflight: usize,
    ) -> Vec<Result<AppendReceipt, AppendError>> {
        if self.agent_identity().is_none() {
            return self.bus.append_batch(events, inflight).await;
        }
        // Room for the request's own fields and headers.
        let budget = (self.bus.client().server_info().max_payload).saturating_sub(4096);
        let mut results = Vec::with_capacity(events.len());
        let mut start = 0;
        while start < events.len() {
            let mut end = start;
            let mut bytes = 0usize;
            while end < events.len() && end - start < proto::limits::MAX_APPEND_EVENTS {
                let size = serde_json::to_vec(&events[end]).map_or(0, |b| b.len()) + 1;
                if end > start && bytes + size > budget {
                    break;
                }
                bytes += size;
                end += 1;
            }
            results.extend(
                self.append_through_service(&events[start..end], AppendOptions::default())
                    .await,
            );
            start = end;
        }
        results
    }

    /// Appends `events` with one request to the query service (an agent's key publishes to
    /// no stream: see `engram_query::append`); one result per event. A request that fails
    /// as a whole fails each event the same way; `unavailable` ones are safe to retry, the
    /// service deduplicates by the same key a direct append uses.
    async fn append_through_service(
        &self,
        events: &[Envelope],
        opts: AppendOptions,
    ) -> Vec<Result<AppendReceipt, AppendError>> {
        let request = proto::AppendRequest {
            events: events.to_vec(),
            expected_last_subject_seq: opts.expected_last_subject_seq,
        };
        let subject_of = |e: &Envelope| engram_schema::subject_for(e);
        // A request the server would refuse for its size is refused here, typed: it is not
        // worth a retry (a transport error would be taken for one).
        let max = self.bus.client().server_info().max_payload;
        let size = serde_json::to_vec(&request).map_or(0, |b| b.len());
        if size > max {
            return events
                .iter()
                .map(|_| Err(AppendError::TooLarge { size, max }))
                .collect();
        }
        match self
            .query::<_, proto::AppendResponse>(proto::APPEND, &request, None)
            .await
        {
            Ok(response) if response.results.len() == events.len() => {
                receipts_of(events, response.results, opts)
            }
            Ok(response) => events
                .iter()
                .map(|_| {
                    Err(AppendError::Rejected(format!(
                        "the query service answered {} results for {} events",
                        response.results.len(),
                        events.len()
                    )))
                })
                .collect(),
            Err(e) => {
                let error = |event: &Envelope| match e.code() {
                    ErrorCode::Forbidden => AppendError::Forbidden {
                        subject: subject_of(event),
                        reason: e.to_string(),
                    },
                    ErrorCode::Invalid => {
                        AppendError::Invalid(engram_schema::SchemaError::Malformed(e.to_string()))
                    }
                    // Busy was retried by `query`; a timeout or a lost connection may or may
                    // not have stored the events: a retry with the same ids is safe.
                    _ => AppendError::Unavailable(e.to_string()),
                };
                events.iter().map(|event| Err(error(event))).collect()
            }
        }
    }

    /// Replays matching events from `start` until caught up. Needs a key that reaches the
    /// stream (the admin's or a service's); an agent pages with [`Client::replay_page`].
    pub async fn replay(
        &self,
        filter: &SubjectFilter,
        start: StartAt,
    ) -> Result<EventStream, BusError> {
        self.refuse_agent("replay")?;
        self.bus.replay(filter, start).await
    }

    /// An agent's key reaches no stream: say what to use instead of waiting for a refusal
    /// that comes as a timeout.
    fn refuse_agent(&self, what: &str) -> Result<(), BusError> {
        match self.agent_identity() {
            Some((tenant, agent)) => Err(BusError::Forbidden(format!(
                "agent {agent} of tenant {tenant} cannot {what} the stream directly: replay through the query service (Client::replay_page, or `engram replay --tenant {tenant} --scope <kind:id>`), or use the admin's credentials"
            ))),
            None => Ok(()),
        }
    }

    /// [`Client::replay`], plus the number of matching events when it started.
    pub async fn replay_counted(
        &self,
        filter: &SubjectFilter,
        start: StartAt,
    ) -> Result<(u64, EventStream), BusError> {
        self.refuse_agent("replay")?;
        self.bus.replay_counted(filter, start).await
    }

    /// Streams matching events appended from now on (the admin's or a service's key).
    pub async fn tail(&self, filter: &SubjectFilter) -> Result<EventStream, BusError> {
        self.refuse_agent("tail")?;
        self.bus.tail(filter).await
    }

    /// Hybrid retrieval through the query service. Set `request.consistency.min_seq` to an
    /// append's sequence to read your own write; a timeout is
    /// `RpcError::Service { code: ErrorCode::NotYetVisible, .. }`, never stale results.
    pub async fn retrieve(&self, request: &RetrieveRequest) -> Result<RetrieveResponse, RpcError> {
        self.query_about(
            proto::RETRIEVE,
            request,
            &request.scopes,
            request.consistency.wait_ms,
        )
        .await
    }

    /// The memory for one agent step, within `request.token_budget` tokens.
    pub async fn build_context(&self, request: &ContextRequest) -> Result<Context, RpcError> {
        self.query_about(
            proto::CONTEXT,
            request,
            &request.scopes,
            request.consistency.wait_ms,
        )
        .await
    }

    /// Facts as they are now, or as they stood (bi-temporal).
    pub async fn facts(&self, request: &FactsRequest) -> Result<FactsResponse, RpcError> {
        self.query_about(
            proto::FACTS,
            request,
            &request.scopes,
            request.consistency.wait_ms,
        )
        .await
    }

    /// Skills by name or by task description.
    pub async fn skills(&self, request: &SkillsRequest) -> Result<SkillsResponse, RpcError> {
        self.query_about(
            proto::SKILLS,
            request,
            &request.scopes,
            request.consistency.wait_ms,
        )
        .await
    }

    /// Consolidates one scope now: asks the consolidator for the scope's plan at
    /// `request.consistency.min_seq` or later (merged near-duplicates, the summary of a
    /// finished session, archived memories) and appends it. The events' ids are derived
    /// from their inputs: a retry, or a scheduled run doing the same, stores each once.
    /// Returns the events planned and their receipts.
    pub async fn consolidate(
        &self,
        request: &proto::ConsolidateRequest,
    ) -> Result<(Vec<Envelope>, Vec<Result<AppendReceipt, AppendError>>), RpcError> {
        // The query service appends the plan: its events are the consolidator's, which no
        // agent's key may author, and only into scopes the caller may write.
        let request = proto::ConsolidateRequest {
            apply: true,
            ..request.clone()
        };
        let plan = self.consolidation_plan(&request).await?;
        let receipts = if plan.results.len() == plan.events.len() {
            receipts_of(&plan.events, plan.results, AppendOptions::default())
        } else {
            // A service from before `apply` returned the plan only: append it here.
            self.append_batch(&plan.events).await
        };
        Ok((plan.events, receipts))
    }

    /// The consolidation plan of one scope, without appending it (a dry run): the events
    /// [`Client::consolidate`] would append.
    pub async fn consolidation_plan(
        &self,
        request: &proto::ConsolidateRequest,
    ) -> Result<proto::ConsolidateResponse, RpcError> {
        self.query(proto::CONSOLIDATE, request, request.consistency.wait_ms)
            .await
    }

    /// Cuts a snapshot of every read model now, optionally labelled (labelled snapshots are
    /// kept by retention; `client.bootstrap(&scopes, Some(version))` starts from one). New
    /// instances bootstrap from the newest snapshot, so a cut after a burst of writes makes
    /// their start faster.
    pub async fn snapshot(
        &self,
        scopes: &proto::ScopeRequest,
        label: Option<&str>,
    ) -> Result<proto::SnapshotCutResponse, RpcError> {
        let request = proto::SnapshotCutRequest {
            scopes: scopes.clone(),
            label: label.map(str::to_owned),
        };
        // A cut copies a whole model: minutes for a large one, which the service allows.
        self.query(proto::SNAPSHOT, &request, Some(600_000)).await
    }

    /// A shared document's state (with its conflicts) at `request.consistency.min_seq` or
    /// later, its history, or the documents of the readable scopes.
    pub async fn doc(&self, request: &DocRequest) -> Result<DocResponse, RpcError> {
        self.query_about(
            proto::DOC,
            request,
            &request.scopes,
            request.consistency.wait_ms,
        )
        .await
    }

    /// Working memory of one scope (put, get, delete, list) through the query service: the
    /// way an agent's key reaches it. Put and delete need a scope the key may write.
    pub async fn working(
        &self,
        request: &proto::WorkingRequest,
    ) -> Result<proto::WorkingResponse, RpcError> {
        self.query(proto::WORKING, request, None).await
    }

    /// The handoff brief of a task (`request.scopes.scope`, a `task:<id>`): its sessions,
    /// what was decided and why, what failed and how it was fixed, what is open, which
    /// skills apply, its artifacts, each citing the events it comes from
    /// ([`engram_memory::proto::BriefRequest`]).
    pub async fn brief(
        &self,
        request: &proto::BriefRequest,
    ) -> Result<proto::BriefResponse, RpcError> {
        // A brief reads many pages and two read models: more than a lookup's time.
        self.query(proto::BRIEF, request, Some(45_000)).await
    }

    /// Who this client's agent key is, as the registry holds it: its scopes and grants.
    /// Agents only (the admin and services are no registry entry).
    pub async fn whoami(&self) -> Result<proto::WhoamiResponse, RpcError> {
        self.query(proto::WHOAMI, &proto::WhoamiRequest::default(), None)
            .await
    }

    /// The scopes of a tenant that hold events, with counts (for an agent, those it may
    /// read).
    pub async fn list_scopes(
        &self,
        request: &proto::ScopesRequest,
    ) -> Result<proto::ScopesResponse, RpcError> {
        self.query(proto::SCOPES, request, None).await
    }

    /// The snapshot index: every read model's snapshots, metadata only.
    pub async fn list_snapshots(
        &self,
        request: &proto::SnapshotsRequest,
    ) -> Result<proto::SnapshotsResponse, RpcError> {
        self.query(proto::SNAPSHOTS, request, None).await
    }

    /// The newest dead letters of a tenant (for an agent, of the scopes it may read).
    pub async fn list_dead_letters(
        &self,
        request: &proto::DeadLettersRequest,
    ) -> Result<proto::DeadLettersResponse, RpcError> {
        self.query(proto::DEAD_LETTERS, request, None).await
    }

    /// One page of the events of `request.scopes` after `request.after_seq`, through the
    /// query service: how an agent replays (its key reaches no stream directly).
    pub async fn replay_page(
        &self,
        request: &proto::ReplayRequest,
    ) -> Result<proto::ReplayResponse, RpcError> {
        self.query(proto::REPLAY, request, None).await
    }

    pub(crate) async fn query<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        subject: &str,
        request: &Req,
        wait_ms: Option<u64>,
    ) -> Result<Resp, RpcError> {
        self.query_inner(subject, request, None, wait_ms).await
    }

    /// [`Client::query`] of a request about the agent's own `scope`: an agent's goes to
    /// `engram.q.<tenant>.<agent>.<op>.<kind>.<id>`, which the server routes to the memory
    /// node owning the scope's partition, so the query is one round trip to the node that
    /// answers it in process.
    pub(crate) async fn query_about<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        subject: &str,
        request: &Req,
        scopes: &proto::ScopeRequest,
        wait_ms: Option<u64>,
    ) -> Result<Resp, RpcError> {
        self.query_inner(subject, request, Some(scopes), wait_ms)
            .await
    }

    async fn query_inner<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        subject: &str,
        request: &Req,
        scopes: Option<&proto::ScopeRequest>,
        wait_ms: Option<u64>,
    ) -> Result<Resp, RpcError> {
        // An agent may use only its own query subjects; the service reads who is asking
        // from them.
        let agent_subject;
        let subject = match self.agent_identity() {
            Some((tenant, agent)) => {
                let op = subject.rsplit('.').next().unwrap_or(subject);
                if let Some(scopes) = scopes {
                    let routed = engram_access::perms::routed_query_subject(
                        tenant,
                        agent,
                        op,
                        &scopes.scope,
                    );
                    match self.ask(&routed, request, wait_ms).await {
                        // No node owns the scope's partition now (a move under way), or
                        // nothing serves routed queries: the query service answers instead,
                        // asking the partition's owner itself, and says which partition is
                        // unserved if none is. One more request, only when routing failed.
                        Err(RpcError::NoResponders { .. }) => {}
                        other => return other,
                    }
                }
                agent_subject = engram_access::perms::query_subject(tenant, agent, op);
                agent_subject.as_str()
            }
            None => {
                // The admin and the services route too, on a form no agent's key reaches.
                if let Some(scopes) = scopes {
                    let op = subject.rsplit('.').next().unwrap_or(subject);
                    let routed = engram_access::perms::privileged_routed_subject(
                        op,
                        &scopes.tenant,
                        &scopes.scope,
                    );
                    match self.ask(&routed, request, wait_ms).await {
                        Err(RpcError::NoResponders { .. }) => {}
                        other => return other,
                    }
                }
                subject
            }
        };
        self.ask(subject, request, wait_ms).await
    }

    /// One request to `subject`, asked again while it is answered busy.
    async fn ask<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        subject: &str,
        request: &Req,
        wait_ms: Option<u64>,
    ) -> Result<Resp, RpcError> {
        // The service's own bound on read-your-writes waits, plus room for the work.
        let timeout = Duration::from_millis(wait_ms.unwrap_or(5_000)) + Duration::from_secs(15);
        let started = tokio::time::Instant::now();
        let mut backoff = engram_rpc::BUSY_RETRY_AFTER.max(self.retry.initial_backoff);
        loop {
            match engram_rpc::call(self.bus.client(), subject, request, timeout).await {
                // Busy is answered before any work is done, so asking again is always safe;
                // other failures may have waited out a read-your-writes token already.
                Err(e)
                    if e.code() == ErrorCode::Busy
                        && self.retry.retry_busy
                        && started.elapsed() + backoff < self.retry.max_elapsed =>
                {
                    tokio::time::sleep(jitter(backoff)).await;
                    backoff = (backoff * 2).min(self.retry.max_backoff);
                }
                other => return other,
            }
        }
    }

    pub async fn working_memory(&self) -> Result<WorkingMemory, BusError> {
        self.bus.working_memory().await
    }
}

/// Spreads retries of many clients so that they do not hit a recovering server in lockstep.
fn jitter(d: Duration) -> Duration {
    d.mul_f64(rand::random_range(0.5..1.0))
}

/// A client bound to one tenant, agent and instance.
#[derive(Clone, Debug)]
pub struct Agent {
    client: Client,
    tenant: Ident,
    agent_id: Ident,
    instance_id: Ident,
}

impl Agent {
    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn tenant(&self) -> &Ident {
        &self.tenant
    }

    /// Starts an event in `scope` with text content.
    pub fn event(
        &self,
        scope: Scope,
        layer: Layer,
        kind: EventKind,
        text: impl Into<String>,
    ) -> EventBuilder<'_> {
        EventBuilder {
            agent: self,
            envelope: Envelope::new(
                self.tenant.clone(),
                scope,
                self.agent_id.clone(),
                self.instance_id.clone(),
                layer,
                kind,
                Content::text(text),
            ),
        }
    }
}

impl Agent {
    /// Withdraws memories of `scope` from retrieval: appends a `forgotten` event naming
    /// their event ids. Only memories recorded in this tenant and `scope` are withdrawn;
    /// other ids are ignored. Wait on the receipt's sequence (`min_seq`) to see it applied.
    pub async fn forget(
        &self,
        scope: Scope,
        layer: Layer,
        event_ids: &[EventId],
        reason: impl Into<String>,
    ) -> Result<AppendReceipt, AppendError> {
        let event = Envelope::forget(
            self.tenant.clone(),
            scope,
            self.agent_id.clone(),
            self.instance_id.clone(),
            layer,
            event_ids,
            reason,
        );
        self.client.append(&event).await
    }

    /// Reports the memories of `scope` this step used (acted on, quoted, found right), in
    /// one `feedback` event appended now: the consolidator reinforces them, so they decay
    /// from now and count a use. At most 1000 ids. This is one write per call, with its
    /// receipt (to wait on the reinforcement, say); an agent reporting at every step should
    /// use [`Agent::usage_reporter`] instead, which aggregates the reports into one event
    /// per scope per interval. The text is empty, so the report is not itself a memory.
    pub async fn used(
        &self,
        scope: Scope,
        event_ids: &[EventId],
    ) -> Result<AppendReceipt, AppendError> {
        let ids: Vec<&str> = event_ids.iter().map(EventId::as_str).collect();
        self.event(scope, Layer::Episodic, EventKind::Feedback, "")
            .data(serde_json::json!({ "used": ids }))
            .append()
            .await
    }
}

/// Builds one event; [`EventBuilder::append`] sends it.
#[derive(Debug)]
#[must_use = "an event is only stored once append() is awaited"]
pub struct EventBuilder<'a> {
    agent: &'a Agent,
    envelope: Envelope,
}

impl EventBuilder<'_> {
    pub fn importance(mut self, importance: f64) -> Self {
        self.envelope.importance = importance;
        self
    }

    pub fn tag(mut self, tag: impl Into<String>) -> Self {
        self.envelope.tags.push(tag.into());
        self
    }

    pub fn data(mut self, data: serde_json::Value) -> Self {
        self.envelope.content.data = Some(data);
        self
    }

    pub fn embedding(mut self, model: impl Into<String>, vector: Vec<f32>) -> Self {
        self.envelope.embedding = Some(Embedding {
            model: model.into(),
            vector,
        });
        self
    }

    pub fn occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.envelope.occurred_at = at;
        self
    }

    pub fn caused_by(mut self, event_id: EventId) -> Self {
        self.envelope.causation_id = Some(event_id);
        self
    }

    pub fn correlation(mut self, id: impl Into<String>) -> Self {
        self.envelope.correlation_id = Some(id.into());
        self
    }

    /// Sets a specific event id (for example one persisted before a crash, to retry safely).
    pub fn event_id(mut self, id: EventId) -> Self {
        self.envelope.event_id = id;
        self
    }

    /// The finished envelope, validated.
    pub fn build(self) -> Result<Envelope, SchemaError> {
        self.envelope.validate()?;
        Ok(self.envelope)
    }

    /// Validates and appends, with retries.
    pub async fn append(self) -> Result<AppendReceipt, AppendError> {
        let agent = self.agent;
        let event = self.build()?;
        agent.client.append(&event).await
    }
}

/// The receipts of `events` from the query service's per-event `results` (as many).
fn receipts_of(
    events: &[Envelope],
    results: Vec<proto::AppendResult>,
    opts: AppendOptions,
) -> Vec<Result<AppendReceipt, AppendError>> {
    events
        .iter()
        .zip(results)
        .map(|(event, r)| match r.error {
            None => Ok(AppendReceipt {
                seq: r.seq.unwrap_or_default(),
                duplicate: r.duplicate,
                subject: engram_schema::subject_for(event),
                event_id: event.event_id.to_string(),
                bytes: r.bytes as usize,
            }),
            Some(f) => Err(append_error(&f, event, opts)),
        })
        .collect()
}

/// The typed error of one event the query service did not append.
fn append_error(f: &proto::AppendFailure, event: &Envelope, opts: AppendOptions) -> AppendError {
    match f.kind.as_str() {
        "invalid" => AppendError::Invalid(engram_schema::SchemaError::Malformed(f.message.clone())),
        "too_large" => AppendError::TooLarge {
            size: f.size.unwrap_or_default() as usize,
            max: f.max.unwrap_or_default() as usize,
        },
        "conflict" => AppendError::Conflict {
            subject: engram_schema::subject_for(event),
            expected: opts.expected_last_subject_seq.unwrap_or_default(),
        },
        "unavailable" => AppendError::Unavailable(f.message.clone()),
        "forbidden" => AppendError::Forbidden {
            subject: engram_schema::subject_for(event),
            reason: f.message.clone(),
        },
        _ => AppendError::Rejected(f.message.clone()),
    }
}
