//! Engram's configuration, layered as operators expect:
//! defaults, then a TOML file, then `ENGRAM_*` environment variables (`__` separates nested
//! keys: `ENGRAM_BUS__STREAM__REPLICAS=3`), then command-line flags, then [`Config::validate`].
//!
//! The TOML file is `--config <path>`, else `$ENGRAM_CONFIG`, else `<home>/engram.toml` if it
//! exists. `engram config dump` prints the merged result.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use engram_bus::BusConfig;
pub use engram_projectors::ProjectorsConfig;
pub use engram_query::QueryConfig;
use engram_telemetry::LogFormat;
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

/// Everything `engram` reads from its configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Data dir: the managed nats-server's store and config live here.
    pub home: PathBuf,
    pub nats: NatsConfig,
    pub leaf: LeafConfig,
    pub bus: BusConfig,
    pub http: HttpConfig,
    pub log: LogConfig,
    /// The read models `engram up` (or `engram projector`) runs, and how.
    pub projectors: ProjectorsConfig,
    /// Ranking defaults and limits of the query service.
    pub query: QueryConfig,
    /// This process as a memory node: its name and how long its partition leases live.
    pub node: engram_node::NodeConfig,
    /// The HTTP API's limits (`/v1`).
    pub gateway: engram_gateway::GatewayConfig,
    /// The MCP server at `/mcp` (`allowed_hosts`, its DNS-rebinding defence).
    pub mcp: engram_mcp::McpConfig,
    /// Who this process connects as: `nats.creds`, else the admin credentials `engram up`
    /// keeps in `<home>/auth/` when they exist. Read from the file at load.
    #[serde(skip)]
    pub identity: Option<engram_bus::NkeyAuth>,
    /// Where this configuration came from, and what starts node processes with it: no
    /// part of its value (two configs alike from different files are equal).
    #[serde(skip)]
    pub origin: Origin,
}

/// Where a [`Config`] came from; equal whatever it holds.
#[derive(Clone, Debug, Default)]
pub struct Origin {
    /// The TOML file it was read from, if any: the node processes `engram up --nodes`
    /// starts read the same.
    pub file: Option<PathBuf>,
    /// The binary `engram up --nodes` starts its nodes with; `None`: this executable. Set by
    /// a process that embeds `engram up` and is not `engram` (a benchmark).
    pub node_bin: Option<PathBuf>,
}

impl PartialEq for Origin {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Which NATS to use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// A running server's URL. When unset, `engram up` starts a managed local nats-server and
    /// the other commands connect to `nats://127.0.0.1:<managed_port>`.
    pub url: Option<String>,
    /// Client port of the managed server. 0 picks a free one (then only `engram up` knows it).
    pub managed_port: u16,
    /// Address the managed server listens on. Agents in other sandboxes need one they can
    /// reach (`0.0.0.0`); only loopback is allowed without authentication.
    pub managed_host: std::net::IpAddr,
    /// Runs the managed server without authentication: anyone who can reach it can read and
    /// write every tenant's memory. Loopback only, and a warning at start-up.
    pub insecure_no_auth: bool,
    /// The credentials file to connect with (from `engram agent add`, or a service's).
    pub creds: Option<PathBuf>,
    /// Managed servers forming one JetStream cluster on this machine (`engram up --cluster
    /// 3`): 0 runs a single server. Node `i` listens on `managed_port + i`, and every
    /// stream, bucket and object store is kept on 3 of them (`bus.stream.replicas`, unless
    /// set to another count).
    pub cluster: usize,
    /// The managed server's JetStream domain: leaf nodes reach its API as
    /// `$JS.<domain>.API`, and `engram leaf add` writes it into a leaf's credentials.
    pub domain: String,
    /// Accept leaf node connections here (`engram up --leaf-listen 0.0.0.0:7422`): laptops
    /// running `engram up --leaf` sync through it. Unset: no leaf can connect.
    pub leafnodes_listen: Option<SocketAddr>,
    /// Whether the hub tells its leaves its other leafnode URLs (a cluster's other nodes),
    /// which they then also connect to. Off when leaves must use only the URL they were
    /// given (behind a proxy or NAT).
    pub leafnodes_advertise: bool,
}

/// Running as a leaf node of a hub (`engram up --leaf <url> --creds <file>`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeafConfig {
    /// The hub's leafnode URL (`nats-leaf://hub.example:7422`); unset: not a leaf.
    pub hub: Option<String>,
    /// The leaf credentials file `engram leaf add` wrote on the hub.
    pub creds: Option<PathBuf>,
    /// How long the outbox keeps an event the hub has not taken yet: the longest this leaf
    /// may stay offline without losing what it wrote. Default 30 days.
    #[serde(default, with = "humantime_serde::option")]
    pub outbox_max_age: Option<std::time::Duration>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Where `/healthz` and `/metrics` are served.
    pub listen: SocketAddr,
    /// `/healthz` answers 503 when a projector's visible sequence trails the stream's last
    /// sequence by more than this many events...
    pub health_max_lag_events: u64,
    /// ...for longer than this.
    #[serde(with = "humantime_serde")]
    pub health_lag_grace: std::time::Duration,
    /// A request's headers must arrive within this long of the connection opening or going
    /// idle; a slow or silent connection is closed.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: std::time::Duration,
    /// A request's whole body must arrive within this long of its headers; past it the
    /// request is answered 408 and the connection closed.
    #[serde(with = "humantime_serde")]
    pub body_read_timeout: std::time::Duration,
    /// HTTP connections open at once; one more is closed as soon as it is accepted.
    pub max_connections: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    pub format: LogFormat,
    /// Tracing filter, e.g. `info` or `engram=debug,async_nats=warn`. `RUST_LOG` wins.
    pub filter: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            home: default_home(),
            nats: NatsConfig::default(),
            leaf: LeafConfig::default(),
            bus: BusConfig::default(),
            http: HttpConfig::default(),
            log: LogConfig::default(),
            projectors: ProjectorsConfig::default(),
            query: QueryConfig::default(),
            node: engram_node::NodeConfig::default(),
            gateway: engram_gateway::GatewayConfig::default(),
            mcp: engram_mcp::McpConfig::default(),
            identity: None,
            origin: Origin::default(),
        }
    }
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            url: None,
            managed_port: 4222,
            managed_host: std::net::IpAddr::from([127, 0, 0, 1]),
            insecure_no_auth: false,
            creds: None,
            cluster: 0,
            domain: engram_access::leaf::DEFAULT_HUB_DOMAIN.into(),
            leafnodes_listen: None,
            leafnodes_advertise: true,
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7077)),
            // A projector restarted on a backlog catches up at thousands of events a second,
            // so a thousand events behind for two minutes is a stall, not a catch-up.
            health_max_lag_events: 1000,
            health_lag_grace: std::time::Duration::from_secs(120),
            header_read_timeout: engram_gateway::ServeLimits::default().header_read_timeout,
            body_read_timeout: engram_gateway::ServeLimits::default().body_read_timeout,
            max_connections: engram_gateway::ServeLimits::default().max_connections,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            // hnsw_rs and foyer log their internals (dumps, reloads, recovery) at info.
            filter: "info,async_nats=warn,hnsw_rs=warn,foyer_storage=warn".into(),
        }
    }
}

/// `$XDG_DATA_HOME/engram`, else `~/.local/share/engram`. (`$ENGRAM_HOME` is the env layer.)
fn default_home() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(dir).join("engram");
    }
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    home.join(".local").join("share").join("engram")
}

/// Values given as command-line flags; `None` leaves the lower layers in force.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FlagOverrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub home: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub managed_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_listen: Option<SocketAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<LogFormat>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creds: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub insecure_no_auth: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leaf_hub: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leaf_creds: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leafnodes_listen: Option<SocketAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {} does not exist; create it or drop --config / ENGRAM_CONFIG", .0.display())]
    MissingFile(PathBuf),
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Top-level keys the env layer may set. Other `ENGRAM_*` variables (ENGRAM_CONFIG,
/// ENGRAM_NATS_SERVER, ENGRAM_CACHE_DIR, benchmark knobs) belong to other readers.
const ENV_KEYS: &[&str] = &[
    "home",
    "nats",
    "leaf",
    "bus",
    "http",
    "log",
    "projectors",
    "query",
    "gateway",
    "mcp",
    "node",
];

impl Config {
    /// Merges every layer and validates the result.
    pub fn load(file: Option<&Path>, flags: &FlagOverrides) -> Result<Self, ConfigError> {
        let (figment, file) = Self::figment(file, flags)?;
        let mut config = figment
            .extract::<Config>()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        // A cluster keeps everything on 3 servers unless told otherwise: one on a single
        // server (the default 1) would be lost with that server.
        if config.nats.cluster >= 3 && config.bus.stream.replicas == 1 {
            config.bus.stream.replicas = 3;
        }
        config.validate()?;
        config.identity = config.load_identity()?;
        config.origin.file = file;
        Ok(config)
    }

    /// The layered configuration, and the TOML file it read, if any.
    fn figment(
        file: Option<&Path>,
        flags: &FlagOverrides,
    ) -> Result<(Figment, Option<PathBuf>), ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        let explicit = file
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("ENGRAM_CONFIG").map(PathBuf::from));
        let file = match explicit {
            Some(path) if !path.is_file() => return Err(ConfigError::MissingFile(path)),
            Some(path) => Some(path),
            None => {
                // The implicit file lives in home, which the env or flags may have moved.
                let home = flags
                    .home
                    .clone()
                    .or_else(|| std::env::var_os("ENGRAM_HOME").map(PathBuf::from))
                    .unwrap_or_else(default_home);
                Some(home.join("engram.toml")).filter(|p| p.is_file())
            }
        };
        if let Some(path) = &file {
            figment = figment.merge(Toml::file_exact(path));
        }
        figment = figment.merge(Env::prefixed("ENGRAM_").split("__").filter(|key| {
            let top = key.as_str().split('.').next().unwrap_or("");
            ENV_KEYS.iter().any(|k| top.eq_ignore_ascii_case(k))
        }));
        let mut layer = figment::value::Dict::new();
        let mut put = |path: &str, value: figment::value::Value| {
            layer.insert(path.to_owned(), value);
        };
        if let Some(home) = &flags.home {
            put("home", home.display().to_string().into());
        }
        if let Some(format) = flags.log_format {
            put(
                "log",
                figment::util::map! { "format" => match format { LogFormat::Text => "text", LogFormat::Json => "json" } }.into(),
            );
        }
        if let Some(listen) = flags.http_listen {
            put(
                "http",
                figment::util::map! { "listen" => listen.to_string() }.into(),
            );
        }
        let mut nats = figment::value::Dict::new();
        if let Some(url) = &flags.nats_url {
            nats.insert("url".into(), url.clone().into());
        }
        if let Some(port) = flags.managed_port {
            nats.insert("managed_port".into(), port.into());
        }
        if let Some(creds) = &flags.creds {
            nats.insert("creds".into(), creds.display().to_string().into());
        }
        if let Some(insecure) = flags.insecure_no_auth {
            nats.insert("insecure_no_auth".into(), insecure.into());
        }
        if let Some(cluster) = flags.cluster {
            nats.insert("cluster".into(), cluster.into());
        }
        if let Some(listen) = flags.leafnodes_listen {
            nats.insert("leafnodes_listen".into(), listen.to_string().into());
        }
        if !nats.is_empty() {
            put("nats", nats.into());
        }
        let mut leaf = figment::value::Dict::new();
        if let Some(hub) = &flags.leaf_hub {
            leaf.insert("hub".into(), hub.clone().into());
        }
        if let Some(creds) = &flags.leaf_creds {
            leaf.insert("creds".into(), creds.display().to_string().into());
        }
        if !leaf.is_empty() {
            put("leaf", leaf.into());
        }
        Ok((figment.merge(Serialized::globals(layer)), file))
    }

    /// Checks the merged config as a whole.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.bus.validate().map_err(ConfigError::Invalid)?;
        if let Some(url) = &self.nats.url
            && !(url.starts_with("nats://") || url.starts_with("tls://") || url.contains(':'))
        {
            return Err(ConfigError::Invalid(format!(
                "nats.url {url:?} is not a NATS URL; use e.g. nats://127.0.0.1:4222"
            )));
        }
        if self.nats.cluster != 0 && !(3..=9).contains(&self.nats.cluster) {
            return Err(ConfigError::Invalid(format!(
                "nats.cluster is {}: a managed cluster has 3 to 9 servers (3 survives losing one, 5 losing two), or 0 for a single server",
                self.nats.cluster
            )));
        }
        if self.nats.cluster != 0 && self.bus.stream.replicas > self.nats.cluster {
            return Err(ConfigError::Invalid(format!(
                "bus.stream.replicas is {} but the managed cluster has {} servers; a stream cannot have more replicas than servers",
                self.bus.stream.replicas, self.nats.cluster
            )));
        }
        self.projectors.validate().map_err(ConfigError::Invalid)?;
        self.query.validate().map_err(ConfigError::Invalid)?;
        self.node.validate().map_err(ConfigError::Invalid)?;
        self.gateway.validate().map_err(ConfigError::Invalid)?;
        self.serve_limits()
            .validate()
            .map_err(ConfigError::Invalid)?;
        self.mcp.validate().map_err(ConfigError::Invalid)?;
        if self.nats.insecure_no_auth && !self.nats.managed_host.is_loopback() {
            return Err(ConfigError::Invalid(format!(
                "nats.insecure_no_auth refuses nats.managed_host {}: without authentication the server may listen on loopback only; drop insecure_no_auth (agents then use credentials from `engram agent add`) or listen on 127.0.0.1",
                self.nats.managed_host
            )));
        }
        if self.nats.insecure_no_auth && !self.http.listen.ip().is_loopback() {
            return Err(ConfigError::Invalid(format!(
                "nats.insecure_no_auth refuses http.listen {}: loopback only without authentication",
                self.http.listen
            )));
        }
        if self.log.filter.trim().is_empty() {
            return Err(ConfigError::Invalid(
                "log.filter is empty; use e.g. \"info\"".into(),
            ));
        }
        Ok(())
    }

    /// The URL clients connect to: `nats.url`, else the managed server's address.
    pub fn client_url(&self) -> String {
        self.nats.url.clone().unwrap_or_else(|| {
            let port = self.nats.managed_port;
            // Every node of a managed cluster, so the client fails over between them.
            (0..self.nats.cluster.max(1) as u16)
                .map(|i| format!("nats://127.0.0.1:{}", port.saturating_add(i)))
                .collect::<Vec<_>>()
                .join(",")
        })
    }

    /// The bus config with the URL resolved, connecting as this process's identity.
    pub fn bus_config(&self, url: String) -> BusConfig {
        BusConfig {
            url,
            nkey: self.identity.clone(),
            ..self.bus.clone()
        }
    }

    /// What one HTTP connection may hold (`[http]`), for [`engram_gateway::serve`].
    pub fn serve_limits(&self) -> engram_gateway::ServeLimits {
        engram_gateway::ServeLimits {
            header_read_timeout: self.http.header_read_timeout,
            body_read_timeout: self.http.body_read_timeout,
            max_connections: self.http.max_connections,
        }
    }

    /// The HTTP API over the server at `url`: each API key connects as its own agent.
    pub fn gateway(&self, url: String) -> std::sync::Arc<engram_gateway::Gateway> {
        engram_gateway::Gateway::new(
            BusConfig {
                url,
                nkey: None,
                ..self.bus.clone()
            },
            self.gateway.clone(),
            self.projectors.scrub.clone(),
        )
    }

    /// The bus config of a connection made as `creds`.
    pub fn bus_config_as(&self, url: String, creds: &engram_access::Credentials) -> BusConfig {
        BusConfig {
            url,
            nkey: Some(engram_bus::NkeyAuth::of(creds)),
            ..self.bus.clone()
        }
    }

    /// `nats.creds`, else the admin's credentials in home if `engram up` made them.
    fn load_identity(&self) -> Result<Option<engram_bus::NkeyAuth>, ConfigError> {
        let path = match &self.nats.creds {
            Some(path) => path.clone(),
            // An agent's key in the environment (`engram run` gives its program one): the
            // CLI acts as that agent, never as the admin whose credentials lie in home.
            None if std::env::var_os("ENGRAM_API_KEY").is_some_and(|k| !k.is_empty()) => {
                let key = std::env::var("ENGRAM_API_KEY").map_err(|_| {
                    ConfigError::Invalid("ENGRAM_API_KEY is not valid UTF-8".into())
                })?;
                let creds = engram_access::Credentials::from_api_key(key.trim())
                    .map_err(|e| ConfigError::Invalid(format!("ENGRAM_API_KEY: {e}")))?;
                return Ok(Some(engram_bus::NkeyAuth::of(&creds)));
            }
            None => {
                let admin =
                    engram_access::creds::service_path(&self.home, engram_access::RoleName::Admin);
                if !admin.exists() || self.nats.insecure_no_auth {
                    return Ok(None);
                }
                admin
            }
        };
        let creds = engram_access::Credentials::load(&path)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(Some(engram_bus::NkeyAuth::of(&creds)))
    }

    /// The merged config as TOML, for `engram config dump`.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config always serialises to toml")
    }

    /// The config as it may be shown: credentials in `nats.url` replaced by `***`.
    pub fn redacted(&self) -> Self {
        let mut shown = self.clone();
        shown.nats.url = shown
            .nats
            .url
            .as_deref()
            .map(engram_bus::config::redact_url);
        shown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_never_shows_credentials() {
        let mut config = Config::default();
        config.nats.url = Some("nats://alice:s3cret@10.0.0.1:4222".into());
        let shown = config.redacted();
        assert_eq!(shown.nats.url.as_deref(), Some("nats://***@10.0.0.1:4222"));
        assert!(!shown.to_toml().contains("s3cret"));
    }
}
