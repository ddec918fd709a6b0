//! The system under test: `engram up` (and in chaos mode, each projector in a process of its
//! own) against a nats-server this crate starts, or a remote deployment given by URL.
//!
//! The load test starts nats-server itself, rather than letting `engram up` manage one, so
//! that chaos mode can `kill -9` it and start it again on the same store and port, and so
//! that the report can give the server's CPU and memory apart from Engram's.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use engram_natsd::{Cluster, ClusterOptions, NatsServer, ServerOptions};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::FleetError;

/// The projectors, in the order reports list them: the registry's, so a new read model is
/// sampled and verified without a line here.
pub fn projectors() -> Vec<&'static str> {
    engram_projectors::ProjectorName::all()
        .into_iter()
        .map(|name| name.as_str())
        .collect()
}

/// How the engram processes get their vectors.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum EmbedderChoice {
    /// The built-in all-MiniLM-L6-v2, as `engram up` runs by default.
    Minilm,
    /// The load test attaches small vectors to each event and query (embedder option "vectors
    /// supplied by the client"): Engram without the embedding cost.
    Client,
}

/// Dimension of the vectors the load test supplies in `Client` mode.
pub const CLIENT_DIM: usize = 64;
/// Model name of those vectors.
pub const CLIENT_MODEL: &str = "loadtest-hash-64";

/// A process this crate started, killed when dropped.
pub(crate) struct Proc {
    pub(crate) name: String,
    child: Option<Child>,
    args: Vec<String>,
    log: PathBuf,
    /// `engram up`'s HTTP address (`host:port`), read from its ready line.
    http: Option<String>,
}

impl Proc {
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }
}

/// The NATS under test: one server, or the nodes of a cluster.
enum Nats {
    Single(Box<NatsServer>),
    Cluster(Cluster),
}

impl Nats {
    fn url(&self) -> String {
        match self {
            Nats::Single(server) => server.url(),
            Nats::Cluster(cluster) => cluster.url(),
        }
    }

    /// Each server by the name chaos and the samples use: "nats-server" alone, "nats-<i>"
    /// for node `i` of a cluster (its `server_name` is `engram-<i>`).
    fn servers(&self) -> Vec<(String, &NatsServer)> {
        match self {
            Nats::Single(server) => vec![("nats-server".to_owned(), server)],
            Nats::Cluster(cluster) => cluster
                .nodes()
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("nats-{i}"), s))
                .collect(),
        }
    }

    fn server_mut(&mut self, name: &str) -> Option<&mut NatsServer> {
        match self {
            Nats::Single(server) => (name == "nats-server").then_some(server),
            Nats::Cluster(cluster) => {
                let i: usize = name.strip_prefix("nats-")?.parse().ok()?;
                (i < cluster.len()).then(|| cluster.node_mut(i))
            }
        }
    }
}

/// The running system under test.
pub struct Target {
    pub url: String,
    nats: Option<Nats>,
    /// `engram up`, then in chaos mode one `engram projector <name>` per projector.
    procs: Vec<Proc>,
    bin: Option<PathBuf>,
    dir: Option<tempfile::TempDir>,
    /// Kept when the run failed, for the logs.
    keep: bool,
    /// Each cluster node behind a link of its own, for cutting it off (network partition
    /// chaos); `Err` says why this machine cannot. Last, so that it goes after the servers.
    lan: Result<engram_natsd::lan::Lan, String>,
}

pub(crate) struct TargetOptions {
    pub(crate) remote: Option<String>,
    pub(crate) engram_bin: Option<PathBuf>,
    pub(crate) separate_projectors: bool,
    pub(crate) embedder: EmbedderChoice,
    pub(crate) extra_config: Option<PathBuf>,
    /// The consolidator's schedule in the engram processes started here (0: off).
    pub(crate) consolidate_every: Duration,
    /// Memory nodes as processes of their own (`engram up --nodes N`); 0 runs one inside
    /// `engram up`.
    pub(crate) nodes: usize,
    /// With nodes: how long a killed node stays down before `engram up` starts it again.
    pub(crate) node_restart_after: Duration,
    /// NATS servers forming one JetStream cluster (every stream on 3 of them); 0 runs one.
    pub(crate) cluster: usize,
    /// Run each cluster node in a network namespace of its own, so that chaos can cut one
    /// off the network (where the machine allows it: root and iproute2).
    pub(crate) partitionable: bool,
}

impl Target {
    pub(crate) async fn start(opts: TargetOptions) -> Result<Self, FleetError> {
        if let Some(url) = opts.remote {
            return Ok(Self {
                url,
                nats: None,
                procs: Vec::new(),
                bin: None,
                dir: None,
                keep: false,
                lan: Err("the deployment is not this run's".into()),
            });
        }
        let bin = locate_engram(opts.engram_bin.as_deref())?;
        let dir = tempfile::Builder::new()
            .prefix("engram-loadtest-")
            .tempdir()
            .map_err(|e| FleetError::Setup(format!("cannot create a temp dir: {e}")))?;
        let nats_bin = tokio::task::spawn_blocking(engram_natsd::locate)
            .await
            .map_err(|e| FleetError::Setup(format!("locating nats-server panicked: {e}")))?
            .map_err(|e| FleetError::Setup(e.to_string()))?;
        // The same config `engram up` writes for its managed server: the shipped file, and
        // the routing of queries to the memory nodes that own their partitions.
        let mut conf = format!(
            "{NATS_CONF}\n{}",
            engram_access::conf::query_routing(engram_bus::BusConfig::default().stream.partitions)
        );
        if opts.cluster > 0 {
            // A frozen node's routes are found dead after ping_interval x ping_max instead
            // of the default 2 minutes x 2, so the freeze of chaos mode outlasts that.
            conf.push_str("\nping_interval: \"2s\"\nping_max: 2\n");
        }
        let conf = write(&dir.path().join("nats/nats-server.conf"), &conf)?;
        let lan = if opts.cluster > 0 && opts.partitionable {
            engram_natsd::lan::Lan::create(opts.cluster)
        } else {
            Err("not asked for".to_owned())
        };
        if opts.partitionable
            && let Err(why) = &lan
        {
            eprintln!("[setup] the cluster runs on loopback; no network partition ({why})");
        }
        let nats = if opts.cluster > 0 {
            let mut cluster_opts =
                ClusterOptions::new(nats_bin, dir.path().join("nats"), opts.cluster);
            cluster_opts.config_file = Some(conf);
            cluster_opts.placement = lan.as_ref().ok().map(engram_natsd::lan::Lan::placement);
            let cluster = Cluster::start(cluster_opts)
                .await
                .map_err(|e| FleetError::Setup(format!("nats-server cluster: {e}")))?;
            Nats::Cluster(cluster)
        } else {
            let mut server_opts = ServerOptions::new(
                nats_bin,
                dir.path().join("nats/store"),
                dir.path().join("nats"),
            );
            server_opts.config_file = Some(conf);
            Nats::Single(Box::new(
                NatsServer::start(server_opts)
                    .await
                    .map_err(|e| FleetError::Setup(format!("nats-server: {e}")))?,
            ))
        };
        let url = nats.url();
        let mut target = Self {
            url,
            nats: Some(nats),
            procs: Vec::new(),
            bin: Some(bin),
            dir: Some(dir),
            keep: false,
            lan,
        };
        let mut base = config_toml(opts.embedder, opts.consolidate_every);
        if opts.cluster > 0 {
            base.push_str(&format!(
                "\n[bus.stream]\nreplicas = {}\n",
                opts.cluster.min(3)
            ));
        }
        let extra = match &opts.extra_config {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| FleetError::Setup(format!("cannot read {}: {e}", path.display())))?,
            None => String::new(),
        };
        let up_config = if opts.separate_projectors {
            format!("{base}\n[projectors]\nrun = []\n{extra}")
        } else if opts.nodes > 0 {
            format!(
                "{base}\n[node]\nrestart_after = \"{}ms\"\n{extra}",
                opts.node_restart_after.as_millis()
            )
        } else {
            format!("{base}\n{extra}")
        };
        let nodes = opts.nodes.to_string();
        let up: &[&str] = if opts.nodes > 0 {
            &["up", "--nodes", &nodes]
        } else {
            &["up"]
        };
        target.spawn("engram", "up", &up_config, up).await?;
        if opts.separate_projectors {
            let config = format!("{base}\n{extra}");
            for name in projectors() {
                target
                    .spawn(
                        name,
                        &format!("projector-{name}"),
                        &config,
                        &["projector", name],
                    )
                    .await?;
            }
        }
        Ok(target)
    }

    /// Starts `engram <args>` with its own home and config, and waits until it is ready:
    /// `up` prints a line when it is, a projector answers on its ledger endpoint.
    async fn spawn(
        &mut self,
        name: &str,
        home: &str,
        config: &str,
        args: &[&str],
    ) -> Result<(), FleetError> {
        let dir = self.dir.as_ref().expect("local targets have a dir").path();
        let home = dir.join(home);
        std::fs::create_dir_all(&home)
            .map_err(|e| FleetError::Setup(format!("cannot create {}: {e}", home.display())))?;
        let config_path = write(&home.join("engram.toml"), config)?;
        let mut full: Vec<String> = vec![
            "--home".into(),
            home.display().to_string(),
            "--config".into(),
            config_path.display().to_string(),
            "--log-format".into(),
            "json".into(),
            "--nats".into(),
            self.url.clone(),
        ];
        full.extend(args.iter().map(|s| (*s).to_owned()));
        if args.first() == Some(&"up") {
            full.extend(["--http".to_owned(), "127.0.0.1:0".to_owned()]);
        }
        let mut proc = Proc {
            name: name.to_owned(),
            child: None,
            args: full,
            log: home.join("engram.log"),
            http: None,
        };
        self.launch(&mut proc).await?;
        self.procs.push(proc);
        Ok(())
    }

    async fn launch(&self, proc: &mut Proc) -> Result<(), FleetError> {
        let bin = self.bin.as_ref().expect("local targets have a binary");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&proc.log)
            .map_err(|e| FleetError::Setup(format!("cannot open {}: {e}", proc.log.display())))?;
        let mut child = Command::new(bin)
            .args(&proc.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| FleetError::Setup(format!("cannot start {}: {e}", bin.display())))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let is_up = proc.args.iter().any(|a| a == "up");
        let mut lines = BufReader::new(stdout).lines();
        // The first start may fetch the embedding model from PyPI.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
        if is_up {
            loop {
                let line = tokio::time::timeout_at(deadline, lines.next_line()).await;
                match line {
                    Ok(Ok(Some(line))) if line.starts_with("engram is up") => {
                        // "engram is up  nats=...  http=http://127.0.0.1:PORT  home=..."
                        proc.http = line
                            .split_whitespace()
                            .find_map(|field| field.strip_prefix("http=http://"))
                            .map(str::to_owned);
                        break;
                    }
                    Ok(Ok(Some(_))) => {}
                    _ => return Err(self.failed_start(proc, &mut child).await),
                }
            }
        }
        // Keep reading stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        proc.child = Some(child);
        if !is_up {
            self.wait_for_projector(proc).await?;
        }
        Ok(())
    }

    async fn wait_for_projector(&self, proc: &mut Proc) -> Result<(), FleetError> {
        let client = engram_bus::config::connect_options(&self.url)
            .connect(&self.url)
            .await
            .map_err(|e| {
                let url = engram_bus::config::redact_url(&self.url);
                FleetError::Setup(format!("cannot connect to {url}: {e}"))
            })?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
        loop {
            if super::sampler::projector_ledger(&client, &proc.name)
                .await
                .is_ok()
            {
                return Ok(());
            }
            let exited = proc
                .child
                .as_mut()
                .is_none_or(|c| matches!(c.try_wait(), Ok(Some(_))));
            if exited || tokio::time::Instant::now() >= deadline {
                let mut child = proc.child.take();
                return Err(match child.as_mut() {
                    Some(child) => self.failed_start(proc, child).await,
                    None => FleetError::Setup(format!("{} did not start", proc.name)),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn failed_start(&self, proc: &Proc, child: &mut Child) -> FleetError {
        let _ = child.start_kill();
        let _ = child.wait().await;
        let log = std::fs::read_to_string(&proc.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        FleetError::Setup(format!(
            "{} did not start; last lines of {}:\n{}",
            proc.name,
            proc.log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ))
    }

    /// The Prometheus endpoint of `engram up` started here; `None` for a remote target.
    pub(crate) fn metrics_url(&self) -> Option<String> {
        self.procs
            .iter()
            .find(|p| p.name == "engram")
            .and_then(|p| p.http.as_ref())
            .map(|addr| format!("http://{addr}/metrics"))
    }

    /// True when the projectors run in processes of their own (chaos mode), which serve
    /// no metrics: `engram up`'s hold none of theirs.
    pub(crate) fn separate_projectors(&self) -> bool {
        self.procs.len() > 1
    }

    /// Processes to sample: (name, pid), the node processes of `engram up --nodes`
    /// (`node-<i>`) and this one (`loadtest`) included.
    pub(crate) fn pids(&self) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        for (name, server) in self.nats.iter().flat_map(Nats::servers) {
            if let Some(pid) = server.pid() {
                out.push((name, pid));
            }
        }
        for proc in &self.procs {
            if let Some(pid) = proc.pid() {
                out.push((proc.name.clone(), pid));
            }
        }
        out.extend(self.node_pids());
        // The load generator shares the machine too: what it uses is what the others lack.
        out.push(("loadtest".to_owned(), std::process::id()));
        out
    }

    /// The node processes `engram up --nodes` runs now, from the pid files it keeps.
    pub(crate) fn node_pids(&self) -> Vec<(String, u32)> {
        let Some(dir) = self.dir.as_ref() else {
            return Vec::new();
        };
        let nodes = dir.path().join("up").join("nodes");
        let mut out: Vec<(String, u32)> = std::fs::read_dir(&nodes)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let i = entry.file_name().to_string_lossy().into_owned();
                let pid = std::fs::read_to_string(entry.path().join("pid")).ok()?;
                Some((format!("node-{i}"), pid.trim().parse().ok()?))
            })
            .collect();
        out.sort();
        out
    }

    /// The NATS servers' names ("nats-server", or "nats-<i>" for a cluster's nodes).
    pub(crate) fn nats_names(&self) -> Vec<String> {
        self.nats
            .iter()
            .flat_map(Nats::servers)
            .map(|(name, _)| name)
            .collect()
    }

    /// SIGSTOP (`freeze`) or SIGCONT of a NATS server by name.
    pub(crate) fn freeze(&mut self, name: &str, freeze: bool) {
        if let Some(server) = self.nats.as_mut().and_then(|n| n.server_mut(name)) {
            if freeze {
                server.pause();
            } else {
                server.resume();
            }
        }
    }

    /// Whether a NATS server can be cut off the network here; `Err` says why not.
    pub(crate) fn partitionable(&self) -> Result<(), String> {
        self.lan.as_ref().map(drop).map_err(Clone::clone)
    }

    /// Cuts the NATS server `name` ("nats-<i>") off the network (`cut`), or heals it.
    pub(crate) fn cut(&self, name: &str, cut: bool) {
        let index = name.strip_prefix("nats-").and_then(|i| i.parse().ok());
        if let (Ok(lan), Some(i)) = (&self.lan, index) {
            if cut {
                lan.cut(i);
            } else {
                lan.heal(i);
            }
        }
    }

    /// SIGTERM to a NATS server by name, waiting for it to exit (a rolling restart's stop).
    pub(crate) async fn stop_nats(&mut self, name: &str) {
        if let Some(server) = self.nats.as_mut().and_then(|n| n.server_mut(name)) {
            server.shutdown(Duration::from_secs(30)).await;
        }
    }

    /// SIGTERM to a node `node-<i>` of `engram up --nodes`, which starts it again at once
    /// (a rolling restart's stop).
    pub(crate) fn stop_node(&self, name: &str) {
        if let Some((_, pid)) = self.node_pids().into_iter().find(|(n, _)| n == name) {
            // SAFETY: kill(2) on a process of this run's (a grandchild), by the pid its
            // supervisor wrote.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        }
    }

    /// `kill -9` of the named process (a projector, a node `node-<i>`, or a NATS server).
    /// A node is not started again here: `engram up` does, after `node.restart_after`.
    pub(crate) async fn kill(&mut self, name: &str) {
        if let Some(server) = self.nats.as_mut().and_then(|n| n.server_mut(name)) {
            server.kill().await;
            return;
        }
        if let Some((_, pid)) = self.node_pids().into_iter().find(|(n, _)| n == name) {
            // SAFETY: kill(2) on a process of this run's (a grandchild), by the pid its
            // supervisor wrote.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            return;
        }
        if let Some(proc) = self.procs.iter_mut().find(|p| p.name == name)
            && let Some(mut child) = proc.child.take()
        {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Starts a killed process again, on the same store (nats-server) or home (engram).
    pub(crate) async fn restart(&mut self, name: &str) -> Result<(), FleetError> {
        if let Some(server) = self.nats.as_mut().and_then(|n| n.server_mut(name)) {
            return server
                .restart()
                .await
                .map_err(|e| FleetError::Setup(format!("{name} restart: {e}")));
        }
        // A node is started again by `engram up`; a name not of this crate's is nothing.
        let Some(index) = self.procs.iter().position(|p| p.name == name) else {
            return Ok(());
        };
        let mut proc = self.procs.remove(index);
        let result = self.launch(&mut proc).await;
        self.procs.insert(index, proc);
        result
    }

    /// Leaves the temp dir (stores, homes, logs) behind and returns its path.
    pub(crate) fn keep_files(&mut self) -> Option<PathBuf> {
        self.keep = true;
        self.dir.as_ref().map(|d| d.path().to_path_buf())
    }

    /// Stops engram processes with SIGTERM (they checkpoint), then nats-server.
    pub(crate) async fn stop(mut self) {
        for proc in self.procs.iter_mut().rev() {
            if let Some(mut child) = proc.child.take() {
                if let Some(pid) = child.id() {
                    // SAFETY: kill(2) on our own child, not yet reaped.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
                }
                if tokio::time::timeout(Duration::from_secs(30), child.wait())
                    .await
                    .is_err()
                {
                    tracing::warn!(process = %proc.name, "no exit 30 s after sigterm, killing");
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                }
            }
        }
        match self.nats.take() {
            Some(Nats::Single(mut server)) => server.shutdown(Duration::from_secs(10)).await,
            Some(Nats::Cluster(mut cluster)) => cluster.shutdown(Duration::from_secs(10)).await,
            None => {}
        }
        if let Some(dir) = self.dir.take() {
            if self.keep {
                let _ = dir.keep();
            } else if let Err(e) = dir.close() {
                tracing::warn!(error = %e, "cannot delete the load test's temp dir");
            }
        }
    }
}

/// The nats-server config `engram up` ships, so the server under test is configured alike.
const NATS_CONF: &str = include_str!("../../../deploy/nats-server.conf");

fn config_toml(embedder: EmbedderChoice, consolidate_every: Duration) -> String {
    let mut out = String::from("[http]\nlisten = \"127.0.0.1:0\"\n");
    // Consolidation runs during the load, often enough to be seen in a short run.
    out.push_str(&format!(
        "\n[projectors.consolidator]\ninterval = \"{}ms\"\n",
        consolidate_every.as_millis()
    ));
    if embedder == EmbedderChoice::Client {
        out.push_str(&format!(
            "\n[projectors.embedder]\nkind = \"client_supplied\"\nmodel = \"{CLIENT_MODEL}\"\ndim = {CLIENT_DIM}\n"
        ));
    }
    out
}

fn write(path: &Path, content: &str) -> Result<PathBuf, FleetError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| FleetError::Setup(format!("cannot create {}: {e}", parent.display())))?;
    }
    std::fs::write(path, content)
        .map_err(|e| FleetError::Setup(format!("cannot write {}: {e}", path.display())))?;
    Ok(path.to_path_buf())
}

/// The `engram` binary: the flag, else `$ENGRAM_BIN`, else next to this executable (cargo puts
/// both in the same target dir), else on `PATH`.
pub(crate) fn locate_engram(flag: Option<&Path>) -> Result<PathBuf, FleetError> {
    if let Some(path) = flag {
        return Ok(path.to_path_buf());
    }
    if let Some(path) = std::env::var_os("ENGRAM_BIN") {
        return Ok(PathBuf::from(path));
    }
    if let Ok(exe) = std::env::current_exe() {
        let mut dir = exe.parent().map(Path::to_path_buf);
        // Test binaries live one level down, in target/<profile>/deps.
        for _ in 0..2 {
            if let Some(d) = &dir {
                let candidate = d.join("engram");
                if candidate.is_file() {
                    return Ok(candidate);
                }
                dir = d.parent().map(Path::to_path_buf);
            }
        }
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("engram");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(FleetError::Setup(
        "cannot find the engram binary; build it (`cargo build --release -p engram`), or pass --engram-bin or set ENGRAM_BIN"
            .into(),
    ))
}
