//! `engram access render`: the nats-server `authorization` block of a server Engram does not
//! run (docker compose, Kubernetes, any external cluster), from that cluster's registry.
//!
//! `engram up` keeps its managed server's block in step with the registry itself
//! ([`engram_access::conf::enforce`]). A server Engram does not run only knows the keys of the
//! `auth.conf` it includes, so agent keys issued later are refused there until something
//! renders the same block from the same registry: this command, run once or, with
//! `--follow`, as a sidecar next to each server that rewrites the file after every change and
//! tells the server (`--then`). It renders with the same functions and the same follower as
//! `engram up`, so the two never disagree on a key.
//!
//! It must never leave the server with less than it had by mistake: it writes nothing until
//! the whole registry has been read, writes atomically (a reader sees the old file or the
//! new), and a lost connection only pauses following, so the block never falls back to the
//! admin and service keys because a read failed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use engram_access::conf::{self, Reload};
use engram_access::{AccessLog, Credentials, Role, RoleName, SharedRegistry};
use tokio_util::sync::CancellationToken;

use crate::config::Config;

#[derive(Debug, clap::Subcommand)]
pub enum AccessCommand {
    /// Print the nats-server `authorization` block `engram up` would write, from the
    /// registry at --nats, for a server it does not run (admin).
    ///
    /// The block admits the admin, the six services and every live agent key. It needs the
    /// admin's credentials (--creds, else <home>/auth/admin.creds) and the services' in
    /// <home>/auth/ (deploy/bin/engram-init-auth keeps all seven there). With --out and
    /// --follow it keeps a file in step with the registry, as a sidecar beside each server
    /// that the server includes; --then tells the server to read it again.
    Render(RenderArgs),
}

#[derive(Debug, clap::Args)]
pub struct RenderArgs {
    /// Write the block to this file instead of stdout: atomically (a new file renamed over
    /// the old), mode 0600, and only when it changed. Point the server's `include` at it.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Keep running: rewrite --out after every registry change that changes the block,
    /// until SIGINT/SIGTERM. A lost NATS connection is logged and retried; the file keeps
    /// the last block read in full meanwhile.
    #[arg(long, requires = "out")]
    pub follow: bool,
    /// A shell command run (`sh -c`) after the file is written, to make the server read it:
    /// `nats-server --signal reload=<pid or pid file>`, or `kill -HUP <pid>`. Also run once
    /// at start, in case an earlier writer stopped before it told the server. A failure is
    /// logged and, with --follow, retried every 5 s; without, the exit code is 1.
    #[arg(long, requires = "out", value_name = "COMMAND")]
    pub then: Option<String>,
    /// The longest --then may run before it is killed (with everything it started).
    #[arg(long, default_value = "30s", value_name = "DURATION")]
    pub then_timeout: humantime::Duration,
}

pub async fn run(config: &Config, command: AccessCommand, json: bool) -> anyhow::Result<ExitCode> {
    match command {
        AccessCommand::Render(args) => render(config, args, json).await,
    }
}

async fn render(config: &Config, args: RenderArgs, json: bool) -> anyhow::Result<ExitCode> {
    // The keys are checked before anything connects: a block without one of them would lock
    // that identity out of the server that includes it.
    let fixed = fixed_keys(config)?;
    let names = crate::up::access_names(config);
    let url = engram_bus::config::redact_url(&config.client_url());
    let client = super::connect(config).await.with_context(|| {
        format!("cannot connect to {url} to read the access registry; check --nats and the admin credentials")
    })?;
    let log = AccessLog::new(client.bus().client().clone());
    let registry = SharedRegistry::default();
    // All of it or nothing: a partial read would render a block missing live keys.
    log.catch_up(&registry).await.with_context(|| {
        format!("cannot read the access registry at {url}; is the server up, and was the registry created (engram up, or deploy/bin/engram-provision)?")
    })?;
    let (text, keys, seq) = {
        let state = registry.read().await;
        let keys = conf::keys_in_force(&fixed, &state);
        (conf::render(&keys, &names), keys.len(), state.applied)
    };
    let then = args
        .then
        .clone()
        .map(|command| then_reload(command, args.then_timeout.into()));
    let Some(out) = args.out else {
        print!("{text}");
        return Ok(ExitCode::SUCCESS);
    };
    let changed = conf::write_if_changed(&out, &text).with_context(|| {
        format!(
            "cannot write {}; check the directory exists and is writable",
            out.display()
        )
    })?;
    if !args.follow {
        if let Some(then) = &then {
            then().await.map_err(|e| {
                anyhow::anyhow!("the authorization is written to {}, but {e}", out.display())
            })?;
        }
        let path = out.display();
        if json {
            println!(
                "{}",
                serde_json::json!({"out": path.to_string(), "keys": keys, "registry_seq": seq, "changed": changed})
            );
        } else {
            let what = if changed {
                "written to"
            } else {
                "already current in"
            };
            println!("authorization for {keys} keys (registry seq {seq}) {what} {path}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    tracing::info!(
        path = %out.display(),
        keys,
        registry_seq = seq,
        changed,
        "authorization rendered; following the access registry"
    );
    let stop = CancellationToken::new();
    log.follow(registry.clone(), stop.clone());
    let reload_at_start = then.is_some();
    conf::keep_in_step(
        registry,
        fixed,
        names,
        out,
        then,
        reload_at_start,
        stop.clone(),
    );
    crate::up::wait_for_signal().await;
    stop.cancel();
    tracing::info!("stopped following the access registry");
    Ok(ExitCode::SUCCESS)
}

/// The admin's key and the six services', as `engram up` lists them before the agents.
/// The admin is whoever this command connects as, so the block always admits its writer.
fn fixed_keys(config: &Config) -> anyhow::Result<Vec<(String, Role)>> {
    let admin_path = config
        .nats
        .creds
        .clone()
        .unwrap_or_else(|| engram_access::creds::service_path(&config.home, RoleName::Admin));
    let admin = load_role(&admin_path, RoleName::Admin).context(
        "engram access render reads the registry as the admin: pass the admin's credentials with --creds, or --home the admin home (deploy/bin/engram-init-auth keeps them in $ENGRAM_HOME/auth/admin.creds)",
    )?;
    let mut fixed = vec![(admin.public_key(), Role::Admin)];
    for role in RoleName::SERVICES {
        let path = engram_access::creds::service_path(&config.home, role);
        let creds = load_role(&path, role).with_context(|| {
            format!(
                "the block must admit the {} service, or it is locked out of the server: put its credentials in {} (engram-init-auth keeps all six in $ENGRAM_HOME/auth/, or copy them from $ENGRAM_SERVICES_OUT), or point --home at that home",
                role.as_str(),
                path.display()
            )
        })?;
        let role = role.fixed_role().expect("a service's role needs no tenant");
        fixed.push((creds.public_key(), role));
    }
    Ok(fixed)
}

fn load_role(path: &Path, role: RoleName) -> anyhow::Result<Credentials> {
    let creds = Credentials::load(path)?;
    anyhow::ensure!(
        creds.role == role,
        "{} holds {} credentials, not {}",
        path.display(),
        creds.role.as_str(),
        role.as_str()
    );
    Ok(creds)
}

/// Why `--then` did not tell the server; each says what to check.
#[derive(Debug, thiserror::Error)]
enum ThenError {
    #[error("--then `{command}` could not be started: {source}; is `sh` on PATH?")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "--then `{command}` failed ({status}){stderr}; run it by hand to see why (is the pid or pid file right, and may this user signal the server?)"
    )]
    Failed {
        command: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error(
        "--then `{command}` did not finish within {timeout:?} and was killed; run it by hand to see where it hangs, or raise --then-timeout"
    )]
    TimedOut { command: String, timeout: Duration },
}

/// `command` as the [`Reload`] the follower runs after each write.
fn then_reload(command: String, timeout: Duration) -> Reload {
    Box::new(move || {
        let command = command.clone();
        Box::pin(async move { run_then(&command, timeout).await.map_err(|e| e.to_string()) })
    })
}

async fn run_then(command: &str, timeout: Duration) -> Result<Duration, ThenError> {
    use tokio::io::AsyncReadExt as _;
    let started = Instant::now();
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        // Its own process group, so that a timeout kills what it started too, not only sh.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| ThenError::Spawn {
            command: command.to_owned(),
            source,
        })?;
    let group = child.id();
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let stderr = tokio::spawn(async move {
        let mut text = Vec::new();
        let _ = stderr.read_to_end(&mut text).await;
        text
    });
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) if status.success() => {
            stderr.abort();
            Ok(started.elapsed())
        }
        Ok(Ok(status)) => {
            // Something it started in the background may hold the pipe open: what came
            // within a second is enough to say why.
            let text = match tokio::time::timeout(Duration::from_secs(1), stderr).await {
                Ok(Ok(text)) => String::from_utf8_lossy(&text).trim().to_owned(),
                _ => String::new(),
            };
            // The end says why; a chatty command's whole output would flood the log.
            let tail = text
                .char_indices()
                .rev()
                .nth(511)
                .map_or(text.as_str(), |(i, _)| &text[i..]);
            Err(ThenError::Failed {
                command: command.to_owned(),
                status,
                stderr: if tail.is_empty() {
                    String::new()
                } else {
                    format!(": {tail}")
                },
            })
        }
        Ok(Err(source)) => Err(ThenError::Spawn {
            command: command.to_owned(),
            source,
        }),
        Err(_) => {
            if let Some(group) = group {
                // SAFETY: kill(2) on the process group of the child started above, whose
                // pid is the group's id and which is not reaped yet, so the id is still
                // ours; only what it started is in that group.
                unsafe { libc::kill(-(group as libc::pid_t), libc::SIGKILL) };
            }
            let _ = child.wait().await;
            stderr.abort();
            Err(ThenError::TimedOut {
                command: command.to_owned(),
                timeout,
            })
        }
    }
}
