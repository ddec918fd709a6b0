//! What the process tests share.

// Each test binary includes this module and uses a part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Command;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// Lines of a child's output, read on a thread of their own, so that waiting for one gives up
/// at a deadline instead of blocking for as long as the child prints nothing.
pub struct Lines {
    rx: Receiver<String>,
    seen: Vec<String>,
}

impl Lines {
    pub fn of(stream: impl Read + Send + 'static) -> Self {
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            rx,
            seen: Vec::new(),
        }
    }

    /// The first line from here on that contains `wanted`; an error saying what happened if
    /// none comes within `timeout` or the output ends first.
    pub fn until(&mut self, wanted: &str, timeout: Duration) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(wanted) {
                        return Ok(line);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("no {wanted:?} line within {timeout:?}"));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!("the output ended before a {wanted:?} line"));
                }
            }
        }
    }

    /// Every line read so far.
    pub fn seen(&self) -> &[String] {
        &self.seen
    }
}

/// Kills the process if the test fails half-way, so no child outlives its test.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value after `key` in a line of `key=value` tokens ("engram is up  nats=…  http=…").
pub fn token<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|t| t.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// The CLI with `home` as its data dir, as a user on the machine running `engram up`, with
/// none of the caller's identity settings.
pub fn cli(home: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_engram"));
    c.env("ENGRAM_HOME", home)
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_CREDS")
        .env_remove("ENGRAM_API_KEY");
    c
}

/// Runs the CLI and returns its stdout, failing with its stderr.
pub fn ok(c: &mut Command) -> String {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        c.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One raw HTTP/1.1 exchange: `head` holds the request line and headers other than `Host`,
/// `Content-Length` and `Connection`; the status and the body. Raw, so a test controls
/// every header (a `Host` the server must refuse, say).
pub fn http_exchange(addr: &str, host: &str, head: &str, body: &str) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(addr).expect("http connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "{head}\r\nHost: {host}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `PATH` with the `engram` under test first, so that programs a test runs (through
/// `engram run` or `task apply`) call that one.
pub fn path_with_engram() -> String {
    let bin_dir = std::path::Path::new(env!("CARGO_BIN_EXE_engram"))
        .parent()
        .expect("the binary is in a directory")
        .to_owned();
    format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// `engram up <args>` with its data in `home` and none of the caller's config, its HTTP on
/// a free port; the child (killed on drop) and its "engram is up" line, waited for at most
/// `ready_within` (a first start may fetch the model; a cluster elects its meta leader).
pub fn spawn_up(
    home: &std::path::Path,
    args: &[&str],
    ready_within: Duration,
) -> (KillOnDrop, String) {
    spawn_up_with(home, args, &[], ready_within)
}

/// [`spawn_up`] with `env` set for it (`ENGRAM_*` configuration).
pub fn spawn_up_with(
    home: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
    ready_within: Duration,
) -> (KillOnDrop, String) {
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_engram"))
            .arg("up")
            .args(args)
            .args(["--http", "127.0.0.1:0"])
            .env("ENGRAM_HOME", home)
            .envs(env.iter().copied())
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_CREDS")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let mut stdout = Lines::of(child.0.stdout.take().unwrap());
    let ready = stdout
        .until("engram is up", ready_within)
        .unwrap_or_else(|e| panic!("engram up {args:?}: {e}"));
    (child, ready)
}

/// `engram up` in the test's process (`engram::up::start`) against `url`: no projectors of
/// its own, HTTP on a free loopback port, state in `home`.
pub fn in_process_up(home: &std::path::Path, url: &str) -> engram::config::Config {
    use engram::config::{Config, HttpConfig, NatsConfig};
    Config {
        home: home.to_owned(),
        nats: NatsConfig {
            url: Some(url.to_owned()),
            ..NatsConfig::default()
        },
        http: HttpConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..HttpConfig::default()
        },
        projectors: engram_projectors::ProjectorsConfig {
            run: Vec::new(),
            ..engram_projectors::ProjectorsConfig::default()
        },
        ..Config::default()
    }
}
