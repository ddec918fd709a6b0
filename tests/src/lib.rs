//! Integration tests live in `tests/`. This library is their harness: Engram's projectors and
//! query service started in-process against a test's own nats-server.

use std::sync::Arc;
use std::time::Duration;

use engram_bus::Bus;
use engram_embed::EmbedderConfig;
use engram_fixtures::HashEmbedder;
use engram_projectors::ProjectorsConfig;
use engram_query::{Query, QueryConfig};
use engram_sdk::{Client, RetryPolicy};
use engram_testkit::TestNats;
use tokio_util::sync::CancellationToken;

/// Vectors in tests are client-supplied from this model: the real MiniLM is exercised by the
/// embed crate's tests and the LoCoMo benchmark.
pub const DIM: usize = 64;

pub fn embedder() -> HashEmbedder {
    HashEmbedder::new(DIM)
}

pub fn projectors_config() -> ProjectorsConfig {
    ProjectorsConfig {
        embedder: EmbedderConfig::ClientSupplied {
            model: embedder_model(),
            dim: DIM,
        },
        checkpoint_interval: Duration::from_millis(300),
        embed_cache_memory_mb: 4,
        embed_cache_disk_mb: 8,
        ..ProjectorsConfig::default()
    }
}

pub fn embedder_model() -> String {
    format!("hash-{DIM}")
}

/// An episodic observation of `tenant`/`scope` by `agent`, with its vector from
/// [`embedder`].
pub fn embedded(
    tenant: &str,
    scope: engram_schema::Scope,
    agent: &str,
    text: &str,
) -> engram_schema::Envelope {
    let ident = |s: &str| engram_schema::Ident::parse("test", s).unwrap();
    let mut e = engram_schema::Envelope::new(
        ident(tenant),
        scope,
        ident(agent),
        ident("i-1"),
        engram_schema::Layer::Episodic,
        engram_schema::EventKind::Observation,
        engram_schema::Content::text(text),
    );
    e.embedding = Some(engram_schema::Embedding {
        model: embedder_model(),
        vector: embedder().embed_one(text),
    });
    e
}

/// A memory node of one test: its projectors and the query service answering from them, as
/// `engram up` runs them.
pub struct Engram {
    pub client: Client,
    pub dir: tempfile::TempDir,
    /// Stops the node and the query service; cancelled on drop too.
    stop: CancellationToken,
    node: Option<engram_node::RunningNode>,
}

impl Drop for Engram {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Engram {
    pub async fn start(nats: &TestNats) -> Self {
        Self::start_with(nats, projectors_config(), QueryConfig::default()).await
    }

    /// With the test's own projector and query settings.
    pub async fn start_with(
        nats: &TestNats,
        projectors: ProjectorsConfig,
        query: QueryConfig,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bus = nats.bus().await;
        let stop = CancellationToken::new();
        let config = nats.bus_config();
        let eligible = projectors.partitions.clone();
        let projectors = engram_projectors::open(
            &projectors,
            dir.path(),
            move |_, _| Bus::connect(config.clone()),
            stop.clone(),
        )
        .await
        .unwrap();
        let query: Arc<Query> = Query::new(bus.clone(), query).await.unwrap();
        query.set_local(projectors.local.clone());
        let responder = nats.bus().await;
        query.serve(responder.client(), stop.clone()).await.unwrap();
        let node = engram_node::start(
            &node_config(),
            eligible,
            dir.path(),
            None,
            engram_node::Parts {
                projectors,
                query,
                responder: responder.client().clone(),
                bus: nats.bus().await,
            },
            stop.clone(),
        )
        .await
        .unwrap();
        Self {
            client: Client::from_bus(bus, RetryPolicy::default()),
            dir,
            stop,
            node: Some(node),
        }
    }

    /// Against a server with authentication: each projector, the consolidator and the query
    /// service connect as their own identity, and the query service checks agents' requests
    /// against the access registry. `client` is the admin's.
    pub async fn start_secured(nats: &engram_testkit::SecureNats) -> Self {
        use engram_access::RoleName;
        use engram_memory::proto::read_models::ModelRole;
        let dir = tempfile::tempdir().unwrap();
        let stop = CancellationToken::new();
        let as_role = |role| nats.config_as(&nats.service(role));
        let identities = [
            RoleName::Projectors,
            RoleName::Consolidator,
            RoleName::ProjectorsResponder,
            RoleName::ConsolidatorResponder,
        ]
        .map(|role| (role, as_role(role)));
        let projectors = engram_projectors::open(
            &projectors_config(),
            dir.path(),
            move |name, link| {
                let worker = match ModelRole::of(name) {
                    ModelRole::Consolidator => RoleName::Consolidator,
                    ModelRole::Projector => RoleName::Projectors,
                };
                let role = match link {
                    engram_rpc::Link::Worker => worker,
                    engram_rpc::Link::Responder => worker.responder().expect("a service"),
                };
                let config = identities
                    .iter()
                    .find(|(r, _)| *r == role)
                    .map(|(_, c)| c.clone())
                    .expect("every service role has credentials");
                Bus::connect(config)
            },
            stop.clone(),
        )
        .await
        .unwrap();
        let query_bus = Bus::connect(nats.config_as(&nats.service(RoleName::Query)))
            .await
            .unwrap();
        let query: Arc<Query> = Query::new(query_bus.clone(), QueryConfig::default())
            .await
            .unwrap();
        query.set_local(projectors.local.clone());
        let registry = engram_access::SharedRegistry::default();
        let log = engram_access::AccessLog::new(query_bus.client().clone());
        log.catch_up(&registry).await.unwrap();
        log.clone().follow(registry.clone(), stop.clone());
        query.set_access(engram_query::access::Guard::new(registry, log));
        let responder = Bus::connect(as_role(RoleName::QueryResponder))
            .await
            .unwrap();
        query.serve(responder.client(), stop.clone()).await.unwrap();
        let node = engram_node::start(
            &node_config(),
            engram_projectors::PartitionSet::all(),
            dir.path(),
            None,
            engram_node::Parts {
                projectors,
                query,
                responder: responder.client().clone(),
                bus: Bus::connect(as_role(RoleName::Projectors)).await.unwrap(),
            },
            stop.clone(),
        )
        .await
        .unwrap();
        Self {
            client: Client::from_bus(nats.admin.clone(), RetryPolicy::default()),
            dir,
            stop,
            node: Some(node),
        }
    }

    /// The partitions this node answers now.
    pub fn serving(&self) -> std::collections::BTreeSet<u32> {
        self.node
            .as_ref()
            .map(|n| n.serving_now())
            .unwrap_or_default()
    }

    /// Stops the node (it hands its partitions back, each model checkpointing).
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(node) = self.node.take() {
            node.join().await.unwrap();
        }
    }
}

/// The memory node settings of tests: production's. A node a test stops hands its
/// partitions back at once; only one killed waits out its leases.
pub fn node_config() -> engram_node::NodeConfig {
    engram_node::NodeConfig::default()
}

/// A `fact_asserted` event of `tenant`/`scope`: `subject` `predicate` `object`.
pub fn fact(
    tenant: &str,
    scope: engram_schema::Scope,
    subject: &str,
    predicate: &str,
    object: &str,
) -> engram_schema::Envelope {
    let mut e = embedded(tenant, scope, "agent-1", "");
    e.embedding = None;
    e.layer = engram_schema::Layer::Semantic;
    e.kind = engram_schema::EventKind::FactAsserted;
    e.content.data = Some(serde_json::json!({
        "subject": subject, "predicate": predicate, "object": object}));
    e
}

/// Writes a task board `name` of `tenant`/`scope` holding one item titled `title`, as
/// agent `lead`; returns the sequence of its change.
pub async fn board_with_item(
    client: &Client,
    tenant: &str,
    scope: engram_schema::Scope,
    name: &str,
    title: &str,
) -> u64 {
    let writer = client.agent(tenant, "lead", "i-lead").unwrap();
    let mut board = writer
        .open_doc::<engram_docs::TaskBoard>(scope, name, None)
        .await
        .unwrap();
    board
        .edit(|b| {
            b.items.insert(
                "t1".into(),
                engram_docs::TaskItem {
                    title: title.to_owned(),
                    ..Default::default()
                },
            );
        })
        .unwrap();
    board.push().await.unwrap().unwrap().seq
}

/// The HTTP API (and `/mcp`, when `mcp` is given) served the way `engram gateway` serves it
/// ([`engram_gateway::serve`], within `limits`, with its `/healthz` and `/metrics`) on a
/// random loopback port, against `nats`, until `stop` completes. Returns the address it
/// listens on.
pub async fn serve_http_with(
    nats: &engram_testkit::SecureNats,
    config: engram_gateway::GatewayConfig,
    limits: engram_gateway::ServeLimits,
    mcp: Option<engram_mcp::McpConfig>,
    stop: CancellationToken,
) -> std::net::SocketAddr {
    let gateway: Arc<engram_gateway::Gateway> = engram_gateway::Gateway::new(
        nats.nats.bus_config(),
        config,
        engram_scrub::ScrubConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut app = engram_gateway::router(gateway.clone(), engram_gateway::Probes::Gateway);
    if let Some(mcp) = mcp {
        let mut mcp = mcp.http(addr);
        mcp.shutdown = stop.clone();
        app = app.merge(engram_mcp::router(gateway, mcp));
    }
    tokio::spawn(async move {
        engram_gateway::serve(listener, app, limits, stop.cancelled_owned())
            .await
            .unwrap();
    });
    addr
}

/// [`serve_http_with`] the default limits, no `/mcp`, for the rest of the test; returns
/// the base URL (`http://127.0.0.1:<port>`).
pub async fn serve_http(
    nats: &engram_testkit::SecureNats,
    config: engram_gateway::GatewayConfig,
) -> String {
    let addr = serve_http_with(
        nats,
        config,
        engram_gateway::ServeLimits::default(),
        None,
        CancellationToken::new(),
    )
    .await;
    format!("http://{addr}")
}

/// A server with authentication, the services, tenant `tenant` and an API key of its agent
/// `agent` with the default scopes: where every HTTP test starts.
pub async fn secured_with_key(
    tenant: &str,
    agent: &str,
) -> (engram_testkit::SecureNats, Engram, String) {
    let nats = TestNats::start_secured().await;
    let engram = Engram::start_secured(&nats).await;
    nats.add_tenant(tenant).await;
    let key = nats.add_agent(tenant, agent, &[]).await.api_key().unwrap();
    (nats, engram, key)
}

/// How long one JSON request to the HTTP API may take in a test.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

async fn json_reply(request: reqwest::RequestBuilder, key: &str) -> (u16, serde_json::Value) {
    let response = request
        .bearer_auth(key)
        .timeout(HTTP_TIMEOUT)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(serde_json::Value::Null);
    (status, body)
}

/// `GET <base><path>` as `key`: the status and the JSON body (`Null` if it is not JSON).
pub async fn get_json(base: &str, path: &str, key: &str) -> (u16, serde_json::Value) {
    json_reply(reqwest::Client::new().get(format!("{base}{path}")), key).await
}

/// `POST <base><path>` of `body` as `key`: the status and the JSON body (`Null` if it is not
/// JSON).
pub async fn post_json(
    base: &str,
    path: &str,
    key: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    json_reply(
        reqwest::Client::new()
            .post(format!("{base}{path}"))
            .json(body),
        key,
    )
    .await
}
