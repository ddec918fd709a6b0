//! `bench-leaf`: how fast a leaf and its hub sync, and how long a leaf takes to catch up
//! after an outage, beside the JetStream sourcing it is built on, in the same run.
//!
//! Two real `engram up` processes (a hub with `--leaf-listen`, a leaf with `--leaf`), their
//! link through a TCP relay this process cuts and heals.
//! - **Up** (leaf to hub): a burst of N appends on the leaf, timed from the first append to
//!   the hub holding all N. The reference: N events published straight into the leaf's
//!   outbox (what the hub sources, skipping the leaf's relay), timed the same way.
//! - **Down** (hub to leaf): a burst of N appends on the hub, timed until the leaf's events
//!   stream holds all N; the reference is the same burst's arrival in the leaf's inbox
//!   (sourcing alone, before the relay moves it).
//! - **Outage**: the link cut for `--outage` while both sides append at `--rate` events a
//!   second each, then healed: the time until each side holds the other's backlog, beside
//!   what the measured burst throughput predicts (backlog ÷ throughput).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use engram_bus::{Bus, BusConfig};
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

/// What to run.
#[derive(Clone, Debug)]
pub struct LeafBenchConfig {
    pub engram_bin: Option<PathBuf>,
    /// Events per burst.
    pub burst: usize,
    /// How long the link stays cut.
    pub outage: Duration,
    /// Appends per second on each side while the link is cut.
    pub rate: f64,
    /// Text bytes per event.
    pub text_bytes: usize,
    pub seed: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub events: usize,
    /// Seconds from the first append until the other side held them all.
    pub seconds: f64,
    pub events_per_sec: f64,
    /// The JetStream sourcing reference of the same phase.
    pub reference_seconds: f64,
    pub reference_events_per_sec: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Outage {
    pub seconds_cut: f64,
    pub leaf_backlog: usize,
    pub hub_backlog: usize,
    /// From the heal until the hub held the leaf's backlog.
    pub up_catch_up_seconds: f64,
    /// From the heal until the leaf held the hub's backlog.
    pub down_catch_up_seconds: f64,
    /// What the burst throughputs predict for the same backlogs.
    pub up_predicted_seconds: f64,
    pub down_predicted_seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct LeafReport {
    pub up: Phase,
    pub down: Phase,
    pub outage: Outage,
    pub text_bytes: usize,
    pub machine: crate::report::Machine,
}

impl LeafReport {
    pub fn render(&self) -> String {
        let p = |name: &str, ph: &Phase, reference: &str| {
            format!(
                "{name:<6} {:>7} events  engram {:>8.0} ev/s ({:>6.2} s)   {reference} {:>8.0} ev/s ({:>6.2} s)   ratio {:.2}\n",
                ph.events,
                ph.events_per_sec,
                ph.seconds,
                ph.reference_events_per_sec,
                ph.reference_seconds,
                ph.events_per_sec / ph.reference_events_per_sec.max(1e-9),
            )
        };
        let o = &self.outage;
        format!(
            "leaf sync ({} text bytes per event)\n{}{}outage  link cut {:.0} s; backlog leaf {} hub {}\n  up:   caught up {:.2} s after the heal (the up burst rate predicts {:.2} s)\n  down: caught up {:.2} s after the heal (the down burst rate predicts {:.2} s)\nmachine: {}\n",
            self.text_bytes,
            p("up", &self.up, "raw outbox sourcing"),
            p("down", &self.down, "raw inbox sourcing"),
            o.seconds_cut,
            o.leaf_backlog,
            o.hub_backlog,
            o.up_catch_up_seconds,
            o.up_predicted_seconds,
            o.down_catch_up_seconds,
            o.down_predicted_seconds,
            machine_line(&self.machine),
        )
    }
}

fn machine_line(m: &crate::report::Machine) -> String {
    format!(
        "{} cpus ({}), load {}",
        m.cpus,
        m.cpu_model.as_deref().unwrap_or("unknown cpu"),
        m.load_avg_1m.map_or("?".into(), |l| format!("{l:.2}"))
    )
}

/// A TCP relay that can be cut (every connection closed, new ones refused) and healed.
struct Link {
    port: u16,
    cut: Arc<AtomicBool>,
    live: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Link {
    async fn start(target: u16) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let live = Arc::new(Mutex::new(Vec::new()));
        let (c, l) = (cut.clone(), live.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let task = tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
                l.lock().await.push(task.abort_handle());
            }
        });
        Ok(Self { port, cut, live })
    }

    async fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for task in self.live.lock().await.drain(..) {
            task.abort();
        }
    }

    fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// A child `engram up`, killed on drop (it is held, never read).
struct Up(#[allow(dead_code)] tokio::process::Child);

async fn spawn_up(bin: &Path, home: &Path, args: &[String]) -> anyhow::Result<Up> {
    let mut child = tokio::process::Command::new(bin)
        .arg("up")
        .args(args)
        .args(["--http", "127.0.0.1:0"])
        .env("ENGRAM_HOME", home)
        .env("ENGRAM_NATS__LEAFNODES_ADVERTISE", "false")
        .env("ENGRAM_LOG__FILTER", "warn")
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_CREDS")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let ready = tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(line) = lines.next_line().await? {
            if line.contains("engram is up") {
                return Ok::<_, std::io::Error>(true);
            }
        }
        Ok(false)
    })
    .await;
    if !matches!(ready, Ok(Ok(true))) {
        anyhow::bail!("engram up {args:?} did not come up");
    }
    // Keep draining its stdout so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Up(child))
}

fn cli(bin: &Path, home: &Path, url: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(bin)
        .args(["--nats", url])
        .args(args)
        .env("ENGRAM_HOME", home)
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_CREDS")
        .output()?;
    if !out.status.success() {
        anyhow::bail!("engram {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn admin_bus(home: &Path, url: &str) -> anyhow::Result<Bus> {
    let creds = engram_access::Credentials::load(&engram_access::creds::service_path(
        home,
        engram_access::RoleName::Admin,
    ))?;
    Ok(Bus::connect(BusConfig {
        url: url.to_owned(),
        nkey: Some(engram_bus::NkeyAuth::of(&creds)),
        ..BusConfig::default()
    })
    .await?)
}

fn events(scope: &str, n: usize, text_bytes: usize, seed: u64) -> Vec<Envelope> {
    let tenant = Ident::parse("tenant", "acme").expect("valid");
    let scope = Scope::new(ScopeKind::Task, scope).expect("valid");
    (0..n)
        .map(|i| {
            let mut text = format!("{seed:x}-{i} ");
            while text.len() < text_bytes {
                text.push_str("the build failed on the login module, retried with a clean cache; ");
            }
            text.truncate(text_bytes);
            Envelope::new(
                tenant.clone(),
                scope.clone(),
                Ident::parse("agent", "bench").expect("valid"),
                Ident::parse("instance", "i-1").expect("valid"),
                Layer::Episodic,
                EventKind::Observation,
                Content::text(text),
            )
        })
        .collect()
}

async fn append_all(bus: &Bus, events: &[Envelope]) -> anyhow::Result<()> {
    for chunk in events.chunks(4096) {
        for r in bus.append_batch(chunk, 512).await {
            r?;
        }
    }
    Ok(())
}

/// Waits until `bus`'s events stream holds `n` events of task `scope`; the time it took.
async fn until_holds(bus: &Bus, scope: &str, n: u64, since: Instant) -> anyhow::Result<f64> {
    let filter = format!("engram.evt.acme.task.{scope}.*.*");
    let deadline = Instant::now() + Duration::from_secs(3600);
    loop {
        if bus.events_on(&filter).await? >= n {
            return Ok(since.elapsed().as_secs_f64());
        }
        anyhow::ensure!(Instant::now() < deadline, "{scope}: never held {n} events");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn run(config: LeafBenchConfig) -> anyhow::Result<LeafReport> {
    let bin = crate::fleet::locate_engram(config.engram_bin.as_deref())?;
    let dirs = (tempfile::tempdir()?, tempfile::tempdir()?);
    let (hub_home, leaf_home) = (dirs.0.path().to_owned(), dirs.1.path().to_owned());
    if std::env::var_os("ENGRAM_BENCH_KEEP").is_some() {
        eprintln!(
            "keeping {} (hub) and {} (leaf)",
            hub_home.display(),
            leaf_home.display()
        );
        let _ = (dirs.0.keep(), dirs.1.keep());
    }
    let (hub_home, leaf_home) = (hub_home.as_path(), leaf_home.as_path());
    let hub_lease = engram_natsd::PortLease::acquire()?;
    let leaf_lease = engram_natsd::PortLease::acquire()?;
    let leafnodes = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let hub_url = format!("nats://127.0.0.1:{}", hub_lease.port());
    let leaf_url = format!("nats://127.0.0.1:{}", leaf_lease.port());
    eprintln!("starting the hub");
    let _hub = spawn_up(
        &bin,
        hub_home,
        &[
            "--nats-port".into(),
            hub_lease.port().to_string(),
            "--leaf-listen".into(),
            format!("127.0.0.1:{leafnodes}"),
        ],
    )
    .await?;
    cli(&bin, hub_home, &hub_url, &["tenant", "add", "acme"])?;
    let creds = hub_home.join("bench.creds");
    cli(
        &bin,
        hub_home,
        &hub_url,
        &[
            "leaf",
            "add",
            "bench",
            "--tenant",
            "acme",
            "--out",
            creds.to_str().unwrap_or_default(),
        ],
    )?;
    let link = Link::start(leafnodes).await?;
    eprintln!("starting the leaf");
    let _leaf = spawn_up(
        &bin,
        leaf_home,
        &[
            "--nats-port".into(),
            leaf_lease.port().to_string(),
            "--leaf".into(),
            format!("nats-leaf://127.0.0.1:{}", link.port),
            "--creds".into(),
            creds.display().to_string(),
        ],
    )
    .await?;
    let (hub, leaf) = (
        admin_bus(hub_home, &hub_url).await?,
        admin_bus(leaf_home, &leaf_url).await?,
    );

    // Warm: one event each way, so both sources run before anything is timed.
    eprintln!("waiting for the link");
    append_all(&leaf, &events("warm-up", 1, 64, config.seed)).await?;
    append_all(&hub, &events("warm-down", 1, 64, config.seed)).await?;
    until_holds(&hub, "warm-up", 1, Instant::now()).await?;
    until_holds(&leaf, "warm-down", 1, Instant::now()).await?;

    let n = config.burst;
    let (bytes, seed) = (config.text_bytes, config.seed);

    eprintln!("up: {n} events through engram");
    let batch = events("burst-up", n, bytes, seed);
    let t = Instant::now();
    append_all(&leaf, &batch).await?;
    let up_s = until_holds(&hub, "burst-up", n as u64, t).await?;

    eprintln!("up: {n} events straight into the outbox (reference)");
    let raw = events("raw-up", n, bytes, seed ^ 1);
    let codec = engram_schema::Codec::new(engram_schema::Limits::default());
    let js = leaf.jetstream();
    let t = Instant::now();
    let mut acks = Vec::with_capacity(n);
    for e in &raw {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", engram_bus::append::dedup_key(e).as_str());
        headers.insert(engram_access::leaf::ORIGIN_HEADER, "bench");
        let subject = format!(
            "{}.{}",
            engram_schema::subject_for(e).replacen(
                "engram.evt",
                engram_access::leaf::OUTBOX_PREFIX,
                1
            ),
            engram_schema::partition_of_event(e, engram_schema::DEFAULT_PARTITIONS)
        );
        acks.push(
            js.publish_with_headers(subject, headers, codec.encode(e)?.into())
                .await?,
        );
        if acks.len() >= 512 {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    let up_ref = until_holds(&hub, "raw-up", n as u64, t).await?;

    eprintln!("down: {n} events through engram");
    let batch = events("burst-down", n, bytes, seed ^ 2);
    let inbox_before = inbox_last_seq(&leaf).await?;
    let t = Instant::now();
    append_all(&hub, &batch).await?;
    let (down_s, down_ref) = {
        let inbox = async {
            let deadline = Instant::now() + Duration::from_secs(3600);
            loop {
                if inbox_last_seq(&leaf).await? >= inbox_before + n as u64 {
                    return Ok::<f64, anyhow::Error>(t.elapsed().as_secs_f64());
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "the inbox never received the burst"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let full = until_holds(&leaf, "burst-down", n as u64, t);
        let (r, f) = tokio::join!(inbox, full);
        (f?, r?)
    };

    eprintln!(
        "outage: cutting the link for {:?}, appending {} a second on each side",
        config.outage, config.rate
    );
    link.cut().await;
    let cut_at = Instant::now();
    let period = Duration::from_secs_f64(1.0 / config.rate.max(0.001));
    let mut ticker = tokio::time::interval(period);
    let (mut on_leaf, mut on_hub) = (0usize, 0usize);
    while cut_at.elapsed() < config.outage {
        ticker.tick().await;
        let i = on_leaf as u64;
        append_all(&leaf, &events("outage-leaf", 1, bytes, seed ^ 3 ^ (i << 8))).await?;
        append_all(&hub, &events("outage-hub", 1, bytes, seed ^ 4 ^ (i << 8))).await?;
        on_leaf += 1;
        on_hub += 1;
        if on_leaf % 1000 == 0 {
            eprintln!(
                "  {:.0} s cut, {on_leaf} events on each side",
                cut_at.elapsed().as_secs_f64()
            );
        }
    }
    let seconds_cut = cut_at.elapsed().as_secs_f64();
    eprintln!("healing the link: backlog {on_leaf} up, {on_hub} down");
    link.heal();
    let healed = Instant::now();
    eprintln!("healed at {}", chrono::Utc::now().format("%H:%M:%S%.3f"));
    let (up_catch, down_catch) = tokio::join!(
        until_holds(&hub, "outage-leaf", on_leaf as u64, healed),
        until_holds(&leaf, "outage-hub", on_hub as u64, healed)
    );
    let phase = |seconds: f64, reference: f64| Phase {
        events: n,
        seconds,
        events_per_sec: n as f64 / seconds.max(1e-9),
        reference_seconds: reference,
        reference_events_per_sec: n as f64 / reference.max(1e-9),
    };
    let (up, down) = (phase(up_s, up_ref), phase(down_s, down_ref));
    let outage = Outage {
        seconds_cut,
        leaf_backlog: on_leaf,
        hub_backlog: on_hub,
        up_catch_up_seconds: up_catch?,
        down_catch_up_seconds: down_catch?,
        up_predicted_seconds: on_leaf as f64 / up.events_per_sec.max(1e-9),
        down_predicted_seconds: on_hub as f64 / down.events_per_sec.max(1e-9),
    };
    Ok(LeafReport {
        up,
        down,
        outage,
        text_bytes: bytes,
        machine: crate::report::Machine::detect(),
    })
}

async fn inbox_last_seq(leaf: &Bus) -> anyhow::Result<u64> {
    let mut inbox = leaf
        .jetstream()
        .get_stream(engram_access::leaf::INBOX_STREAM)
        .await?;
    Ok(inbox.info().await?.state.last_sequence)
}
