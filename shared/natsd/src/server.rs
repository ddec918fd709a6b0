use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use crate::{NatsdError, PortLease};

/// How to run a local nats-server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The nats-server binary; see [`crate::locate`].
    pub bin: PathBuf,
    /// JetStream store. Reusing it across restarts is what makes a restart durable.
    pub store_dir: PathBuf,
    /// Where the server's ports file and log go.
    pub run_dir: PathBuf,
    /// Client port; `None` leases one ([`PortLease`]), held for the server's life, so a
    /// restart finds it still free.
    pub port: Option<u16>,
    /// Optional config file (`deploy/nats-server.conf`).
    pub config_file: Option<PathBuf>,
    /// Address to listen on; loopback unless told otherwise.
    pub host: std::net::IpAddr,
    /// How long to wait for the server to listen.
    pub start_timeout: Duration,
    /// `server_name`, which JetStream clustering needs unique per node; `None` keeps the
    /// config file's.
    pub server_name: Option<String>,
    /// Membership of a cluster; `None` runs a server of its own.
    pub cluster: Option<ClusterMembership>,
    /// A network namespace to run the server in (a path such as `/run/netns/<name>`), so
    /// that a test can cut this one node off the network; `None` runs it in ours.
    pub netns: Option<PathBuf>,
}

/// How one server joins a cluster: passed as flags, so every node can share one config file.
#[derive(Clone, Debug)]
pub struct ClusterMembership {
    /// The cluster's name, the same on every node.
    pub name: String,
    /// This node's route port on the server's host.
    pub port: u16,
    /// Every node's route URL (`nats-route://host:port`), this one's included: the server
    /// ignores a route to itself, and one list for all keeps the nodes' configs alike.
    pub routes: Vec<String>,
}

impl ServerOptions {
    pub fn new(bin: PathBuf, store_dir: PathBuf, run_dir: PathBuf) -> Self {
        Self {
            bin,
            store_dir,
            run_dir,
            port: None,
            config_file: None,
            host: std::net::IpAddr::from([127, 0, 0, 1]),
            start_timeout: Duration::from_secs(30),
            server_name: None,
            cluster: None,
            netns: None,
        }
    }
}

/// A running child nats-server with JetStream enabled.
///
/// Dropping it kills the process (SIGKILL). Use [`NatsServer::shutdown`] for a graceful stop.
#[derive(Debug)]
pub struct NatsServer {
    opts: ServerOptions,
    /// The live child; `None` between [`NatsServer::kill`] and [`NatsServer::restart`].
    child: Option<Child>,
    /// Fixed after the first start so that clients reconnect to the same address.
    port: u16,
    /// Keeps a port this server was not given free for it across kills and restarts.
    _lease: Option<PortLease>,
}

impl NatsServer {
    /// Starts the server and waits until it accepts clients.
    pub async fn start(opts: ServerOptions) -> Result<Self, NatsdError> {
        let lease = match opts.port {
            Some(_) => None,
            None => Some(PortLease::acquire()?),
        };
        let mut server = Self {
            port: opts
                .port
                .or_else(|| lease.as_ref().map(PortLease::port))
                .unwrap_or(0),
            opts,
            child: None,
            _lease: lease,
        };
        server.spawn().await?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!(
            "nats://{}",
            std::net::SocketAddr::new(self.opts.host, self.port)
        )
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    pub fn store_dir(&self) -> &Path {
        &self.opts.store_dir
    }

    pub fn log_path(&self) -> PathBuf {
        self.opts.run_dir.join("nats-server.log")
    }

    /// Kills the process with SIGKILL, as a crash would, and reaps it.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Freezes the process (SIGSTOP): it keeps its sockets but answers nothing, as a node
    /// that hangs or is partitioned away would. [`NatsServer::resume`] continues it.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Continues a paused process (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        if let Some(pid) = self.pid() {
            // SAFETY: plain kill(2) on our own child's pid, which is not yet reaped.
            unsafe { libc::kill(pid as libc::pid_t, signal) };
        }
    }

    /// Starts the server again on the same port and store.
    pub async fn restart(&mut self) -> Result<(), NatsdError> {
        self.kill().await;
        self.spawn().await
    }

    /// SIGTERM, then SIGKILL if the server has not exited within `grace`.
    pub async fn shutdown(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            // SAFETY: plain kill(2) on our own child's pid, which is not yet reaped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        }
        if tokio::time::timeout(grace, child.wait()).await.is_err() {
            tracing::warn!(
                grace_ms = grace.as_millis() as u64,
                "nats-server ignored sigterm, killing it"
            );
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Makes the server read its config file again; see [`Reloader::reload`].
    pub async fn reload(&self, timeout: Duration) -> Result<Duration, NatsdError> {
        self.reloader()?.reload(timeout).await
    }

    /// A handle that reloads this server's config from another task.
    pub fn reloader(&self) -> Result<Reloader, NatsdError> {
        Ok(Reloader {
            pid: self.pid().ok_or_else(|| NatsdError::ReloadFailed {
                reason: "the server is not running".into(),
            })?,
            log_path: self.log_path(),
        })
    }

    /// True if the child is running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The file the server reads: the given one, or with a name or cluster membership, one of
    /// this node's own that includes it and adds them. They go in a file rather than flags
    /// because a reload (SIGHUP) re-reads only the file: a cluster given by flags makes every
    /// reload fail ("jetstream cluster requires `cluster.name` to be set").
    fn config_file(&self) -> Result<Option<PathBuf>, NatsdError> {
        let opts = &self.opts;
        if opts.server_name.is_none() && opts.cluster.is_none() {
            return Ok(opts.config_file.clone());
        }
        let mut text =
            String::from("# Written by engram for this node; edit the file it includes.\n");
        // Beside the shared file, since nats-server resolves includes from the including
        // file's directory (and the shared file's own includes from there too).
        let dir = match &opts.config_file {
            Some(shared) => {
                let name = shared
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default();
                text.push_str(&format!("include \"{name}\"\n"));
                shared
                    .parent()
                    .map_or_else(|| opts.run_dir.clone(), Path::to_path_buf)
            }
            None => opts.run_dir.clone(),
        };
        let name = opts
            .server_name
            .clone()
            .unwrap_or_else(|| format!("nats-{}", self.port));
        text.push_str(&format!("server_name: \"{name}\"\n"));
        if let Some(cluster) = &opts.cluster {
            let routes: Vec<String> = cluster.routes.iter().map(|r| format!("\"{r}\"")).collect();
            text.push_str(&format!(
                "cluster {{\n  name: \"{}\"\n  listen: \"{}:{}\"\n  routes: [{}]\n}}\n",
                cluster.name,
                opts.host,
                cluster.port,
                routes.join(", ")
            ));
        }
        let path = dir.join(format!("{name}.conf"));
        std::fs::write(&path, text)
            .map_err(NatsdError::io(format!("writing {}", path.display())))?;
        Ok(Some(path))
    }

    async fn spawn(&mut self) -> Result<(), NatsdError> {
        let opts = &self.opts;
        for dir in [&opts.store_dir, &opts.run_dir] {
            std::fs::create_dir_all(dir)
                .map_err(NatsdError::io(format!("creating {}", dir.display())))?;
        }
        let ports_dir = opts.run_dir.join("ports");
        let _ = std::fs::remove_dir_all(&ports_dir);
        std::fs::create_dir_all(&ports_dir).map_err(NatsdError::io("creating ports dir"))?;
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(NatsdError::io(format!("opening {}", log_path.display())))?;
        let log_err = log
            .try_clone()
            .map_err(NatsdError::io("cloning log handle"))?;

        let mut cmd = Command::new(&opts.bin);
        if let Some(config) = self.config_file()? {
            cmd.arg("-c").arg(config);
        }
        let port = self.port.to_string();
        let host = opts.host.to_string();
        cmd.arg("-js")
            .arg("-sd")
            .arg(&opts.store_dir)
            .args(["-a", &host, "-p", &port])
            .arg("--ports_file_dir")
            .arg(&ports_dir);
        cmd.stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .kill_on_drop(true);
        // Opened here, before the fork: the child only enters it.
        let netns = match &opts.netns {
            Some(path) => Some(
                std::fs::File::open(path)
                    .map_err(NatsdError::io(format!("opening {}", path.display())))?,
            ),
            None => None,
        };
        let netns_fd = netns.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        // SAFETY: prctl and setns are async-signal-safe syscalls and touch no memory of the
        // parent; the namespace's fd stays open in the parent until after the spawn.
        // Why PDEATHSIG: if the engram process is killed outright, its nats-server must not
        // outlive it and keep the store locked. The signal fires when the spawning *thread*
        // exits, so this must be called from a long-lived runtime thread, never from the
        // blocking pool.
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if let Some(fd) = netns_fd
                    && libc::setns(fd, libc::CLONE_NEWNET) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(NatsdError::io(format!("spawning {}", opts.bin.display())))?;
        drop(netns);
        let pid = child.id().unwrap_or_default();

        let deadline = Instant::now() + opts.start_timeout;
        let ports_file = ports_dir.join(format!(
            "{}_{pid}.ports",
            opts.bin
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("nats-server")
        ));
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(NatsdError::StartFailed {
                    reason: format!("it exited with {status}"),
                    log_tail: tail(&log_path),
                });
            }
            if let Some(port) = read_client_port(&ports_file) {
                self.port = port;
                break;
            }
            if Instant::now() > deadline {
                let _ = child.start_kill();
                return Err(NatsdError::StartFailed {
                    reason: format!("no ports file after {:?}", opts.start_timeout),
                    log_tail: tail(&log_path),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tracing::debug!(pid, port = self.port, store = %opts.store_dir.display(), "nats-server started");
        self.child = Some(child);
        Ok(())
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
    }
}

/// The ports file is JSON like `{"nats":["nats://127.0.0.1:4222"],...}`, written once the
/// Reloads one running server's config (see [`NatsServer::reloader`]).
#[derive(Clone, Debug)]
pub struct Reloader {
    pid: u32,
    log_path: PathBuf,
}

impl Reloader {
    /// Makes the server read its config file again (SIGHUP) and waits until it says it did,
    /// at most `timeout`. This is how authorization changes take effect: connections whose
    /// key the new config no longer lists are closed by the server in the same reload.
    pub async fn reload(&self, timeout: Duration) -> Result<Duration, NatsdError> {
        let (pid, log_path) = (self.pid, self.log_path.clone());
        // Only what the server logs after the signal counts: the log can be long.
        let offset = std::fs::metadata(&log_path).map_or(0, |m| m.len());
        let since = || -> String {
            use std::io::{Read as _, Seek as _};
            let mut text = String::new();
            if let Ok(mut f) = std::fs::File::open(&log_path)
                && f.seek(std::io::SeekFrom::Start(offset)).is_ok()
            {
                let _ = f.read_to_string(&mut text);
            }
            text
        };
        let started = Instant::now();
        // SAFETY: plain kill(2) on our own child's pid, which is not yet reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGHUP) };
        loop {
            let now = since();
            if now.contains(RELOADED) {
                return Ok(started.elapsed());
            }
            if now.contains(RELOAD_FAILED) {
                return Err(NatsdError::ReloadFailed {
                    reason: now
                        .lines()
                        .rev()
                        .find(|l| l.contains(RELOAD_FAILED))
                        .unwrap_or_default()
                        .to_owned(),
                });
            }
            if started.elapsed() > timeout {
                return Err(NatsdError::ReloadFailed {
                    reason: format!("the server did not confirm a reload within {timeout:?}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// What nats-server logs after a reload, and after one it refused.
const RELOADED: &str = "Reloaded server configuration";
const RELOAD_FAILED: &str = "Failed to reload server configuration";

/// listeners are up, which makes it a readiness signal as well as the random port's source.
fn read_client_port(path: &Path) -> Option<u16> {
    #[derive(serde::Deserialize)]
    struct Ports {
        nats: Vec<String>,
    }
    let text = std::fs::read_to_string(path).ok()?;
    let ports: Ports = serde_json::from_str(&text).ok()?;
    ports.nats.first()?.rsplit(':').next()?.parse().ok()
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn starts_on_a_random_port_and_restarts_on_the_same_one() {
        let bin = tokio::task::spawn_blocking(crate::locate)
            .await
            .unwrap()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut server = NatsServer::start(ServerOptions::new(
            bin,
            dir.path().join("store"),
            dir.path().join("run"),
        ))
        .await
        .unwrap();
        let port = server.port();
        assert_ne!(port, 0);
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());

        server.kill().await;
        assert!(!server.is_running());
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());

        server.restart().await.unwrap();
        assert_eq!(server.port(), port);
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
        server.shutdown(Duration::from_secs(5)).await;
        assert!(!server.is_running());
    }
}
