//! `engram up --nodes N`: N memory nodes as processes of their own on this machine, for
//! tests, benchmarks and demos of scale-out. Each is `engram node` with its own state dir
//! (`<home>/nodes/<i>`), name (`node-<i>`) and log (`<home>/nodes/<i>/node.log`), and the
//! same home, server and service identities as this process, serving `/healthz` and
//! `/metrics` on a port of its own (its membership entry says where). A node that dies is
//! started again after `node.restart_after` (its partitions move to the others once its
//! leases expire, and back to it once it has caught up); one stopped with SIGTERM after
//! running a while (it hands its partitions back) is started again at once. Each one's pid is kept in
//! `<home>/nodes/<i>/pid` for whoever wants to kill one.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engram_bus::Bus;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::up::UpError;

/// The node processes, each supervised by a task of its own.
pub struct Children {
    count: usize,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The live child of each node, for an orderly stop.
    pids: Arc<Mutex<Vec<Option<u32>>>>,
    pub dirs: Vec<PathBuf>,
}

impl Children {
    /// Starts `count` node processes against `nats_url`.
    pub fn spawn(config: &Config, nats_url: &str, count: usize) -> Result<Self, UpError> {
        // `node_bin` for a process that embeds `engram up` but is not `engram` itself (a
        // benchmark), else this executable.
        let exe = match &config.origin.node_bin {
            Some(bin) => bin.clone(),
            None => std::env::current_exe().map_err(|source| UpError::Home {
                path: "the engram executable".into(),
                source,
            })?,
        };
        let stop = CancellationToken::new();
        let pids = Arc::new(Mutex::new(vec![None; count]));
        let mut tasks = Vec::new();
        let mut dirs = Vec::new();
        for i in 0..count {
            let dir = config.home.join("nodes").join(i.to_string());
            std::fs::create_dir_all(&dir).map_err(|source| UpError::Home {
                path: dir.display().to_string(),
                source,
            })?;
            let mut args: Vec<String> = vec![
                "--home".into(),
                config.home.display().to_string(),
                "--nats".into(),
                nats_url.to_owned(),
                "node".into(),
                "--state-dir".into(),
                dir.display().to_string(),
                "--name".into(),
                format!("node-{i}"),
                "--http".into(),
                "127.0.0.1:0".into(),
            ];
            // The same configuration file as this process; the environment is inherited.
            if let Some(path) = &config.origin.file {
                args.splice(0..0, ["--config".to_owned(), path.display().to_string()]);
            }
            tasks.push(tokio::spawn(supervise(
                i,
                (exe.clone(), args),
                dir.clone(),
                config.bus.stream.replicas,
                config.node.restart_after,
                pids.clone(),
                stop.clone(),
            )));
            dirs.push(dir);
        }
        Ok(Self {
            count,
            stop,
            tasks,
            pids,
            dirs,
        })
    }

    /// Waits until the nodes serve every partition between them (or a minute passes, when
    /// it says which partitions no node serves yet).
    pub async fn wait_serving(&self, bus: &Bus, config: &Config) -> Result<(), UpError> {
        let partitions = config.bus.stream.partitions;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let serving = engram_node::serving(bus, &config.node.bucket).await;
            let missing: Vec<u32> = (0..partitions)
                .filter(|p| !serving.as_ref().is_ok_and(|s| s.contains(p)))
                .collect();
            if missing.is_empty() {
                tracing::info!(nodes = self.count, "memory nodes serve every partition");
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    ?missing,
                    "no memory node serves these partitions yet; queries of them are unavailable until one does"
                );
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops every node (SIGTERM: each hands its partitions back and checkpoints), waiting
    /// for them.
    pub async fn shutdown(self) {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        drop(self.pids);
    }
}

/// How long a node that ran at least this long before a clean exit counts as stopped on
/// purpose rather than failing at start-up.
const STEADY: Duration = Duration::from_secs(10);

/// How long to wait before starting a node again that exited (`clean`: status 0) after
/// running for `ran`.
fn restart_delay(clean: bool, ran: Duration, restart_after: Duration) -> Duration {
    if clean && ran >= STEADY {
        Duration::ZERO
    } else {
        restart_after
    }
}

/// Runs node `i` until `stop`, starting it again whenever it exits.
async fn supervise(
    i: usize,
    (exe, args): (PathBuf, Vec<String>),
    dir: PathBuf,
    replicas: usize,
    restart_after: Duration,
    pids: Arc<Mutex<Vec<Option<u32>>>>,
    stop: CancellationToken,
) {
    loop {
        let log = match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("node.log"))
        {
            Ok(log) => log,
            Err(e) => {
                tracing::error!(node = i, error = %e, "cannot open the node's log");
                return;
            }
        };
        let mut command = tokio::process::Command::new(&exe);
        command
            .args(&args)
            // Whatever `--cluster` made of the replicas, the nodes make theirs the same.
            .env("ENGRAM_BUS__STREAM__REPLICAS", replicas.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(
                log.try_clone()
                    .map_or_else(|_| std::process::Stdio::null(), Into::into),
            )
            .stderr(log)
            .kill_on_drop(true);
        // The node dies with this process, however this process ends.
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                tracing::error!(node = i, error = %e, "cannot start a memory node");
                return;
            }
        };
        let pid = child.id();
        pids.lock().unwrap_or_else(|p| p.into_inner())[i] = pid;
        if let Some(pid) = pid {
            let _ = std::fs::write(dir.join("pid"), format!("{pid}\n"));
        }
        tracing::info!(node = i, pid, "memory node started");
        let started = tokio::time::Instant::now();
        tokio::select! {
            status = child.wait() => {
                // A node that ran a while and exited cleanly was asked to stop (SIGTERM: a
                // rolling restart), having handed its partitions back: it is started again
                // at once, so the restart costs its start-up only. One that died, or exited
                // straight after starting (a loop), waits `restart_after`.
                let delay = restart_delay(
                    status.as_ref().is_ok_and(std::process::ExitStatus::success),
                    started.elapsed(),
                    restart_after,
                );
                tracing::warn!(node = i, ?status, ?delay, "memory node exited; starting it again");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(delay) => continue,
                }
            }
            () = stop.cancelled() => {
                if let Some(pid) = pid {
                    // SAFETY: a signal to our own child, which has not been reaped yet.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
                }
                match tokio::time::timeout(Duration::from_secs(60), child.wait()).await {
                    Ok(_) => tracing::info!(node = i, "memory node stopped"),
                    Err(_) => {
                        tracing::warn!(node = i, "memory node did not stop in a minute; killing it");
                        let _ = child.kill().await;
                    }
                }
                let _ = std::fs::remove_file(dir.join("pid"));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_clean_exit_after_a_steady_run_restarts_at_once() {
        let after = Duration::from_secs(40);
        assert_eq!(restart_delay(true, STEADY, after), Duration::ZERO);
        // Killed, crashed, or exiting in a loop: the configured wait.
        assert_eq!(restart_delay(false, Duration::from_secs(600), after), after);
        assert_eq!(
            restart_delay(true, STEADY - Duration::from_millis(1), after),
            after
        );
    }
}
