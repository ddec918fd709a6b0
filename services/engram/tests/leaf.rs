//! Leaf nodes as a user runs them: a hub (`engram up --leaf-listen`) and a leaf (`engram up
//! --leaf … --creds …`), two real processes with their own nats-servers, homes and JetStream
//! domains. The link between them runs through a TCP relay in this test, which cuts it for
//! real (every connection closed, new ones refused) and heals it.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{KillOnDrop, cli, ok};

/// A TCP relay from a local port to `target` that can be cut and healed.
struct Link {
    port: u16,
    cut: Arc<AtomicBool>,
    live: Arc<Mutex<Vec<TcpStream>>>,
}

impl Link {
    fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let live = Arc::new(Mutex::new(Vec::<TcpStream>::new()));
        let (c, l) = (cut.clone(), live.clone());
        std::thread::spawn(move || {
            for inbound in listener.incoming() {
                let Ok(inbound) = inbound else { continue };
                if c.load(Ordering::SeqCst) {
                    let _ = inbound.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                {
                    let mut live = l.lock().unwrap();
                    live.push(inbound.try_clone().unwrap());
                    live.push(outbound.try_clone().unwrap());
                }
                for (mut from, mut to) in [
                    (inbound.try_clone().unwrap(), outbound.try_clone().unwrap()),
                    (outbound, inbound),
                ] {
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        loop {
                            match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    if to.write_all(&buf[..n]).is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Self { port, cut, live }
    }

    /// Closes every connection through the link and refuses new ones.
    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `engram up <args>` with its data in `home`; leaves use only the URL they were given
/// (through the relay), never one the hub advertises.
fn spawn_up(home: &std::path::Path, args: &[&str], ready_within: Duration) -> (KillOnDrop, String) {
    common::spawn_up_with(
        home,
        args,
        &[("ENGRAM_NATS__LEAFNODES_ADVERTISE", "false")],
        ready_within,
    )
}

/// A hub with a leaf of tenant `acme` syncing `task:*` and `session:*`, linked through a
/// cuttable relay.
struct Pair {
    hub: Side,
    leaf: Side,
    creds: std::path::PathBuf,
    link: Link,
    _hub_up: KillOnDrop,
    leaf_up: KillOnDrop,
    leaf_args: Vec<String>,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
    _leases: (engram_natsd::PortLease, engram_natsd::PortLease),
}

impl Pair {
    /// Kills the leaf's `engram up` (and with it its nats-server) with SIGKILL.
    fn kill_leaf(&mut self) {
        let _ = self.leaf_up.0.kill();
        let _ = self.leaf_up.0.wait();
    }

    /// Starts the leaf again on the same home and ports.
    fn start_leaf(&mut self) {
        let (up, _) = spawn_up(
            &self.leaf.home,
            &self
                .leaf_args
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            Duration::from_secs(120),
        );
        self.leaf_up = up;
    }
}

/// One Engram: its home and its NATS URL, for the CLI.
struct Side {
    home: std::path::PathBuf,
    url: String,
}

impl Side {
    fn cli(&self) -> std::process::Command {
        let mut c = cli(&self.home);
        c.args(["--nats", &self.url]);
        c
    }
}

fn start_pair() -> Pair {
    let (hub_dir, leaf_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (hub_lease, leaf_lease) = (
        engram_natsd::PortLease::acquire().unwrap(),
        engram_natsd::PortLease::acquire().unwrap(),
    );
    let hub = Side {
        home: hub_dir.path().to_owned(),
        url: format!("nats://127.0.0.1:{}", hub_lease.port()),
    };
    let leaf = Side {
        home: leaf_dir.path().to_owned(),
        url: format!("nats://127.0.0.1:{}", leaf_lease.port()),
    };
    let leafnodes = free_port();
    let (hub_up, _) = spawn_up(
        &hub.home,
        &[
            "--nats-port",
            &hub_lease.port().to_string(),
            "--leaf-listen",
            &format!("127.0.0.1:{leafnodes}"),
        ],
        Duration::from_secs(120),
    );
    ok(hub.cli().args(["tenant", "add", "acme"]));
    ok(hub.cli().args(["tenant", "add", "beta"]));
    let creds = hub.home.join("laptop.creds");
    ok(hub.cli().args([
        "leaf",
        "add",
        "laptop",
        "--tenant",
        "acme",
        "--out",
        creds.to_str().unwrap(),
    ]));
    let link = Link::start(leafnodes);
    let leaf_args: Vec<String> = vec![
        "--nats-port".into(),
        leaf_lease.port().to_string(),
        "--leaf".into(),
        format!("nats-leaf://127.0.0.1:{}", link.port),
        "--creds".into(),
        creds.to_str().unwrap().into(),
    ];
    let (leaf_up, _) = spawn_up(
        &leaf.home,
        &leaf_args.iter().map(String::as_str).collect::<Vec<_>>(),
        Duration::from_secs(120),
    );
    Pair {
        hub,
        leaf,
        creds,
        link,
        _hub_up: hub_up,
        leaf_up,
        leaf_args,
        _dirs: (hub_dir, leaf_dir),
        _leases: (hub_lease, leaf_lease),
    }
}

/// Appends one event with `text` to `scope` of `tenant` on the Engram in `home`.
fn append(side: &Side, tenant: &str, scope: &str, text: &str) {
    ok(side.cli().args([
        "append", "--tenant", tenant, "--scope", scope, "--text", text,
    ]));
}

/// Every stored event of `tenant` on the Engram in `home`: event id to how many times it is
/// stored, and id to text.
fn stored(side: &Side, tenant: &str) -> (BTreeMap<String, usize>, BTreeMap<String, String>) {
    let out = ok(side.cli().args(["--json", "replay", "--tenant", tenant]));
    let mut counts = BTreeMap::new();
    let mut texts = BTreeMap::new();
    for line in out.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let Some(event) = v.get("event") else {
            continue;
        };
        let id = event["event_id"].as_str().unwrap().to_owned();
        *counts.entry(id.clone()).or_insert(0) += 1;
        texts.insert(
            id,
            event["content"]["text"].as_str().unwrap_or("").to_owned(),
        );
    }
    (counts, texts)
}

fn texts_of(side: &Side, tenant: &str) -> std::collections::BTreeSet<String> {
    stored(side, tenant).1.into_values().collect()
}

/// The stream sequence `side` stores the event with `text` at.
fn seq_of(side: &Side, tenant: &str, text: &str) -> u64 {
    let out = ok(side.cli().args(["--json", "replay", "--tenant", tenant]));
    out.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"]["content"]["text"] == text)
        .and_then(|v| v["seq"].as_u64())
        .unwrap_or_else(|| panic!("no event {text:?} on {}", side.url))
}

/// Lines of `engram --json <args>` output, parsed.
fn json_lines(side: &Side, args: &[&str]) -> Vec<serde_json::Value> {
    let mut c = side.cli();
    c.arg("--json").args(args);
    ok(&mut c)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A facts listing without what differs from side to side by construction (sequences and
/// the ids made of them): what the fact says and when it holds.
fn facts_of(side: &Side, scope: &str) -> Vec<serde_json::Value> {
    let mut facts: Vec<serde_json::Value> = json_lines(
        side,
        &[
            "facts", "--tenant", "acme", "--scope", scope, "--limit", "1000",
        ],
    )
    .into_iter()
    .map(|f| {
        serde_json::json!({
            "subject": f["subject"], "predicate": f["predicate"], "object": f["object"],
            "valid_from": f["valid_from"], "valid_to": f["valid_to"],
        })
    })
    .collect();
    facts.sort_by_key(|f| f.to_string());
    facts
}

fn doc_of(side: &Side, what: &str) -> Vec<serde_json::Value> {
    json_lines(
        side,
        &[
            "doc",
            what,
            "task_board",
            "main",
            "--tenant",
            "acme",
            "--scope",
            "task:t2",
        ],
    )
}

fn assert_fact(side: &Side, scope: &str, object: &str) {
    ok(side.cli().args([
        "append",
        "--tenant",
        "acme",
        "--scope",
        scope,
        "--layer",
        "semantic",
        "--kind",
        "fact_asserted",
        &format!(
            r#"{{"content":{{"text":"alice is {object}","data":{{"subject":"alice","predicate":"role","object":"{object}"}}}}}}"#
        ),
    ]));
}

/// [`start_pair`], once an event of the hub has reached the leaf: the link is up.
fn start_linked_pair() -> Pair {
    let pair = start_pair();
    append(&pair.hub, "acme", "task:t1", "hub first");
    wait_for("the link", Duration::from_secs(90), || {
        texts_of(&pair.leaf, "acme").contains("hub first")
    });
    pair
}

/// JetStream on `side`'s server as its admin (the whole server in hand).
async fn admin_js(side: &Side) -> async_nats::jetstream::Context {
    let admin = engram_access::Credentials::load(&engram_access::creds::service_path(
        &side.home,
        engram_access::RoleName::Admin,
    ))
    .unwrap();
    let nc = engram_bus::handshake(|| {
        async_nats::ConnectOptions::with_nkey(admin.seed.clone()).connect(&side.url)
    })
    .await
    .unwrap();
    async_nats::jetstream::new(nc)
}

/// On the leaf (`js`), a stream `name` sourcing the hub's `source` with `filter`, exactly as
/// the leaf's inbox does: what a leaf operator could set up by hand.
async fn source_from_hub(
    js: &async_nats::jetstream::Context,
    name: &str,
    source: &str,
    filter: &str,
) {
    use async_nats::jetstream::stream;
    js.create_stream(stream::Config {
        name: name.into(),
        sources: Some(vec![stream::Source {
            name: source.into(),
            filter_subject: Some(filter.into()),
            external: Some(stream::External {
                api_prefix: "$JS.hub.API".into(),
                delivery_prefix: Some(format!("engram.leaf.laptop.down.{}", name.to_lowercase())),
            }),
            ..Default::default()
        }]),
        ..Default::default()
    })
    .await
    .unwrap();
}

/// How many messages stream `name` holds.
async fn messages_in(js: &async_nats::jetstream::Context, name: &str) -> u64 {
    let mut s = js.get_stream(name).await.unwrap();
    s.info().await.unwrap().state.messages
}

/// Waits until stream `name` holds a message (a control source delivered).
async fn until_filled(js: &async_nats::jetstream::Context, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while messages_in(js, name).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the {name} source never delivered"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn wait_for(what: &str, timeout: Duration, check: impl FnMut() -> bool) {
    wait_for_or(what, timeout, check, String::new);
}

/// [`wait_for`], whose failure also says what `state` finds then.
fn wait_for_or(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> bool,
    state: impl FnOnce() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !check() {
        if Instant::now() >= deadline {
            panic!("timed out waiting for {what}\n{}", state());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Where a sync stands, for a failure's message: each side's events of `tenant` by the
/// first word of their text, the leaf relays' backlogs, and every source's state on both
/// sides' streams.
fn sync_state(pair: &Pair, tenant: &str) -> String {
    let by_word = |side: &Side| {
        let mut words = BTreeMap::<String, usize>::new();
        for text in stored(side, tenant).1.into_values() {
            let word = text.split(' ').next().unwrap_or("").to_owned();
            *words.entry(word).or_default() += 1;
        }
        words
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sources = |side: &Side| {
        rt.block_on(async {
            let js = admin_js(side).await;
            let mut names = js.stream_names();
            let mut out = Vec::new();
            while let Some(Ok(name)) = futures::StreamExt::next(&mut names).await {
                let Ok(mut stream) = js.get_stream(&name).await else {
                    continue;
                };
                let Ok(info) = stream.info().await else {
                    continue;
                };
                let (messages, last) = (info.state.messages, info.state.last_sequence);
                let mut line = format!("{name}: {messages} messages, last seq {last}");
                for s in &info.sources {
                    line.push_str(&format!(
                        "\n    source {} lag {} active {:?}",
                        s.name, s.lag, s.active
                    ));
                }
                out.push(line);
            }
            out.join("\n  ")
        })
    };
    let relays = rt.block_on(async {
        let js = admin_js(&pair.leaf).await;
        engram_leaf::relay::pending(&js, "ENGRAM_EVENTS").await
    });
    format!(
        "hub events by first word: {:?}\nleaf events by first word: {:?}\nleaf relays pending (up, down): {relays:?}\nhub streams:\n  {}\nleaf streams:\n  {}",
        by_word(&pair.hub),
        by_word(&pair.leaf),
        sources(&pair.hub),
        sources(&pair.leaf),
    )
}

#[test]
fn a_leaf_and_its_hub_write_through_a_cut_link_and_converge_on_the_same_events() {
    let pair = start_pair();
    let (hub, leaf) = (&pair.hub, &pair.leaf);
    assert!(std::fs::metadata(&pair.creds).is_ok());

    // Linked: each side's event reaches the other; another tenant's and an unsynced scope's
    // never reach the leaf.
    append(hub, "acme", "task:t1", "hub before");
    append(hub, "acme", "agent:zed", "hub private");
    append(hub, "beta", "task:t1", "beta before");
    append(leaf, "acme", "task:t1", "leaf before");
    let linked = Duration::from_secs(90);
    wait_for("the first events to cross both ways", linked, || {
        let (h, l) = (texts_of(hub, "acme"), texts_of(leaf, "acme"));
        h.contains("leaf before") && l.contains("hub before")
    });

    // A task board both sides will edit, and an event both will append after,
    // optimistically, each expecting it to be the last of its subject.
    ok(hub.cli().args([
        "doc",
        "edit",
        "task_board",
        "main",
        "--tenant",
        "acme",
        "--scope",
        "task:t2",
        "--set",
        r#"/items/a={"title":"fix login","status":"todo"}"#,
    ]));
    append(hub, "acme", "task:occ", "occ base");
    wait_for("the board and the base event on the leaf", linked, || {
        texts_of(leaf, "acme").contains("occ base")
            && doc_of(leaf, "show")
                .first()
                .is_some_and(|d| d.to_string().contains("fix login"))
    });
    let base = (
        seq_of(hub, "acme", "occ base"),
        seq_of(leaf, "acme", "occ base"),
    );

    // Cut: both sides go on writing, each at local speed.
    pair.link.cut();
    const EACH: usize = 12;
    for i in 0..EACH {
        append(hub, "acme", "task:t2", &format!("hub during {i}"));
        append(leaf, "acme", "task:t2", &format!("leaf during {i}"));
    }
    // Concurrent edits of one field of the board, and of one single-valued fact.
    for (side, status) in [(hub, "doing"), (leaf, "done")] {
        ok(side.cli().args([
            "doc",
            "edit",
            "task_board",
            "main",
            "--tenant",
            "acme",
            "--scope",
            "task:t2",
            "--set",
            &format!("/items/a/status=\"{status}\""),
        ]));
    }
    assert_fact(hub, "task:t2", "lead");
    assert_fact(leaf, "task:t2", "reviewer");
    // A skill learnt offline.
    ok(leaf.cli().args([
        "append", "--tenant", "acme", "--scope", "task:t2", "--layer", "procedural",
        "--kind", "skill_recorded",
        r#"{"content":{"text":"clean the cache before retrying a failed build","data":{"name":"retry-clean-cache","description":"clean the build cache, then retry the failed build"}}}"#,
    ]));
    // Both optimistic appends are accepted, each by its own side.
    for (side, seq, text) in [(hub, base.0, "hub occ"), (leaf, base.1, "leaf occ")] {
        ok(side.cli().args([
            "append",
            "--tenant",
            "acme",
            "--scope",
            "task:occ",
            "--text",
            text,
            "--expect-last-seq",
            &seq.to_string(),
        ]));
    }
    assert!(
        json_lines(hub, &["conflicts", "--tenant", "acme"])[0]
            .as_array()
            .unwrap()
            .is_empty(),
        "a conflict before the two sides met"
    );
    // The cut is real: nothing written during it has crossed (a leaf connection retries
    // every few seconds, and each attempt is refused).
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !texts_of(hub, "acme")
            .iter()
            .any(|t| t.starts_with("leaf during"))
    );
    assert!(
        !texts_of(leaf, "acme")
            .iter()
            .any(|t| t.starts_with("hub during"))
    );

    // Healed: both sides reach the same events, each stored once.
    pair.link.heal();
    // The task events of both sides, the base and the two optimistic ones, the board's three
    // changes, the two facts, the skill, and the hub's agent:zed.
    let want = 2 + 1 + 2 * EACH + 2 + 3 + 2 + 1 + 1;
    wait_for("both sides to converge", Duration::from_secs(180), || {
        stored(hub, "acme").0.len() == want && stored(leaf, "acme").0.len() == want - 1
    });
    // Settle: nothing more arrives (no echo of an event back to the side that wrote it).
    std::thread::sleep(Duration::from_secs(5));
    let (h, h_texts) = stored(hub, "acme");
    let (l, _) = stored(leaf, "acme");
    assert!(
        h.values().all(|&n| n == 1),
        "hub stores an event twice: {h:?}"
    );
    assert!(
        l.values().all(|&n| n == 1),
        "leaf stores an event twice: {l:?}"
    );
    let zed: Vec<&String> = h_texts
        .iter()
        .filter(|(_, t)| *t == "hub private")
        .map(|(id, _)| id)
        .collect();
    let mut hub_synced = h.clone();
    for id in zed {
        hub_synced.remove(id);
    }
    assert_eq!(
        hub_synced.keys().collect::<Vec<_>>(),
        l.keys().collect::<Vec<_>>(),
        "the two sides hold different events"
    );
    assert!(
        stored(leaf, "beta").0.is_empty(),
        "another tenant's events reached the leaf"
    );

    // The read models agree: the same facts (the later assertion current on both sides),
    // the same merged board with the same conflict exposed.
    wait_for(
        "the same facts on both sides",
        Duration::from_secs(60),
        || {
            let (h, l) = (facts_of(hub, "task:t2"), facts_of(leaf, "task:t2"));
            !h.is_empty() && h == l
        },
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (h, l) = (doc_of(hub, "conflicts"), doc_of(leaf, "conflicts"));
        // The merged state and its change history (heads), without the sequences each
        // side stores them at.
        let merged = |side: &Side| -> Vec<serde_json::Value> {
            doc_of(side, "show")
                .iter()
                .map(|d| serde_json::json!([d["doc"]["heads"], d["doc"]["value"], d["conflicts"]]))
                .collect()
        };
        let (hs, ls) = (merged(hub), merged(leaf));
        if !h.is_empty() && h == l && hs == ls {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sides' boards differ:\nhub conflicts {h:?}\nleaf conflicts {l:?}\nhub {hs:?}\nleaf {ls:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let conflicts = doc_of(hub, "conflicts")
        .iter()
        .map(ToString::to_string)
        .collect::<String>();
    assert!(
        conflicts.contains("doing") && conflicts.contains("done"),
        "the board's conflict does not show both values: {conflicts}"
    );
    // Every synced scope's read models digest the same on both sides.
    for scope in ["task:t1", "task:t2", "task:occ"] {
        let digest = |side: &Side| {
            json_lines(side, &["digest", "--tenant", "acme", "--scope", scope])[0]["models"].clone()
        };
        wait_for(
            &format!("the same digests of {scope}"),
            Duration::from_secs(60),
            || digest(hub) == digest(leaf),
        );
        let d = digest(hub);
        assert!(d["events"]["count"].as_u64().unwrap() > 0, "{scope}: {d}");
        if scope == "task:t2" {
            assert!(d["facts"]["count"].as_u64().unwrap() > 0, "{d}");
            assert_eq!(d["docs"]["count"], 1, "{d}");
            assert_eq!(d["skills"]["count"], 1, "{d}");
        }
    }
    // The optimistic appends: neither was refused, so each side reports the same conflict,
    // naming both events.
    let on = |side: &Side| json_lines(side, &["conflicts", "--tenant", "acme"])[0].clone();
    let (h, l) = (on(hub), on(leaf));
    let ids = |c: &serde_json::Value| -> Vec<String> {
        c[0]["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["event_id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(h.as_array().unwrap().len(), 1, "{h}");
    assert_eq!(ids(&h).len(), 2, "{h}");
    assert_eq!(
        ids(&h),
        ids(&l),
        "the sides report different conflicts: {h} {l}"
    );
    assert_eq!(h[0]["subject"], "engram.evt.acme.task.occ.episodic");

    // The leaf reports its link up and nothing waiting.
    let status: serde_json::Value =
        serde_json::from_str(ok(leaf.cli().args(["--json", "leaf", "status"])).trim()).unwrap();
    assert_eq!(status["linked"], true, "{status}");
    assert_eq!(status["up_pending"], 0, "{status}");
    assert_eq!(status["down_pending"], 0, "{status}");
}

/// The leaf's own operator (its admin, with the whole leaf server in hand) tries to pull
/// another tenant's events from the hub and to push events into another tenant's scopes.
/// The hub refuses all of it; the same leaf's legitimate sync keeps working beside.
#[test]
fn a_hostile_leaf_gets_no_other_tenants_events_and_cannot_write_into_them() {
    let pair = start_pair();
    let (hub, leaf) = (&pair.hub, &pair.leaf);
    append(hub, "beta", "task:t1", "beta secret");
    append(hub, "acme", "task:t1", "acme shared");
    wait_for("the leaf to sync", Duration::from_secs(90), || {
        texts_of(leaf, "acme").contains("acme shared")
    });

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let js = admin_js(leaf).await;
        let nc = js.client();
        let hub_api = "$JS.hub.API";
        // Two streams sourcing the hub exactly as the inbox does: one on beta's scopes (not
        // the leaf's), one on acme's (the control: it must fill while the other stays empty).
        // And one on beta's working memory (the hub holds an entry of it).
        admin_js(hub)
            .await
            .get_key_value("engram_working")
            .await
            .unwrap()
            .put("beta.session.s1.plan", "beta's".to_owned().into())
            .await
            .unwrap();
        for (name, source, filter) in [
            ("STEAL", "ENGRAM_EVENTS", "engram.evt.beta.task.*.*.*"),
            ("STEALKV", "KV_engram_working", "$KV.engram_working.beta.>"),
            ("CONTROL", "ENGRAM_EVENTS", "engram.evt.acme.task.*.*.*"),
        ] {
            source_from_hub(&js, name, source, filter).await;
        }
        // Everything of the hub's API but creating a consumer on the leaf's own scopes is
        // refused: stream info, direct gets of another tenant's last event.
        for subject in [
            format!("{hub_api}.STREAM.INFO.ENGRAM_EVENTS"),
            format!("{hub_api}.DIRECT.GET.ENGRAM_EVENTS.engram.evt.beta.task.t1.episodic.>"),
            format!("{hub_api}.STREAM.LIST"),
        ] {
            let answer = tokio::time::timeout(
                Duration::from_secs(3),
                nc.request(subject.clone(), "".into()),
            )
            .await;
            assert!(
                !matches!(answer, Ok(Ok(_))),
                "the hub answered {subject}: {answer:?}"
            );
        }
        // A forged beta event: in the leaf's outbox (which the hub sources) and on the event
        // subject itself (which the leaf may not publish to the hub).
        let forged = engram_testkit::event("beta", "t1", "forged by the leaf");
        let payload = engram_schema::Codec::new(engram_schema::Limits::default())
            .encode(&forged)
            .unwrap();
        let id = format!("beta:{}", forged.event_id);
        for subject in [
            "engram.out.beta.task.t1.episodic.3",
            "engram.evt.beta.task.t1.episodic",
        ] {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            nc.publish_with_headers(subject, headers, payload.clone().into())
                .await
                .unwrap();
        }
        nc.flush().await.unwrap();
        // The control source delivers; by then the other has had its chance.
        until_filled(&js, "CONTROL").await;
        for name in ["STEAL", "STEALKV"] {
            assert_eq!(
                messages_in(&js, name).await,
                0,
                "another tenant's memory reached the leaf ({name})"
            );
        }
    });
    // A new event of acme still goes up (the hub sourced the outbox after the forgery was
    // stored in it), and nothing forged is among beta's events on the hub.
    append(leaf, "acme", "task:t1", "after the forgery");
    wait_for(
        "the leaf's next event to reach the hub",
        Duration::from_secs(90),
        || texts_of(hub, "acme").contains("after the forgery"),
    );
    assert_eq!(
        texts_of(hub, "beta").into_iter().collect::<Vec<_>>(),
        ["beta secret"],
        "a forged event reached another tenant on the hub"
    );
}

/// A leaf killed with SIGKILL in the middle of syncing, both sides writing, and started
/// again: every event reaches both sides once, none twice, whatever the relays and sources
/// were doing when it died.
#[test]
fn a_leaf_killed_mid_sync_resumes_where_it_stopped() {
    let mut pair = start_linked_pair();
    // Both sides write a batch at once (one CLI call each, many events), and the leaf dies
    // while they cross.
    const N: usize = 300;
    let batch = |who: &str| -> String {
        (0..N)
            .map(|i| {
                format!(
                    r#"{{"scope":{{"kind":"task","id":"t3"}},"content":{{"text":"{who} {i}"}}}}"#
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let write = |side: &Side, who: &str| {
        let mut c = side.cli();
        c.args(["append", "--tenant", "acme"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null());
        let mut child = c.spawn().unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(batch(who).as_bytes())
            .unwrap();
        assert!(child.wait().unwrap().success(), "{who}'s append failed");
    };
    write(&pair.leaf, "leaf");
    write(&pair.hub, "hub");
    // Some of the leaf's batch has reached the hub (the relays are at work), not all.
    wait_for(
        "the leaf's batch to start crossing",
        Duration::from_secs(60),
        || {
            texts_of(&pair.hub, "acme")
                .iter()
                .any(|t| t.starts_with("leaf "))
        },
    );
    pair.kill_leaf();
    append(&pair.hub, "acme", "task:t1", "hub while the leaf is down");
    pair.start_leaf();
    append(&pair.leaf, "acme", "task:t1", "leaf after its restart");
    let want = 1 + 2 * N + 2;
    wait_for_or(
        "both sides to hold everything",
        Duration::from_secs(180),
        || stored(&pair.hub, "acme").0.len() == want && stored(&pair.leaf, "acme").0.len() == want,
        || sync_state(&pair, "acme"),
    );
    std::thread::sleep(Duration::from_secs(3));
    let (h, _) = stored(&pair.hub, "acme");
    let (l, _) = stored(&pair.leaf, "acme");
    assert!(h.values().all(|&n| n == 1), "the hub stores an event twice");
    assert!(
        l.values().all(|&n| n == 1),
        "the leaf stores an event twice"
    );
    assert_eq!(h.keys().collect::<Vec<_>>(), l.keys().collect::<Vec<_>>());
}

/// The ids of the hub's leaf connections, from its servers' LEAFZ, asked as the system
/// account `engram up` made. An error is the monitoring request's own (a hub reloading its
/// authorization after a grant changes may refuse or drop it for a moment): callers wait
/// through it rather than fail on it.
fn leaf_connections(hub: &Side) -> Result<Vec<u64>, String> {
    let creds = engram_access::Credentials::load(&hub.home.join("nats/system.creds")).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let nc = engram_bus::handshake(|| {
            async_nats::ConnectOptions::with_nkey(creds.seed.clone()).connect(&hub.url)
        })
        .await
        .map_err(|e| format!("connecting as the system account: {e}"))?;
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            nc.request("$SYS.REQ.SERVER.PING.LEAFZ", "{}".into()),
        )
        .await
        .map_err(|_| "LEAFZ: no answer in 5 s".to_owned())?
        .map_err(|e| format!("LEAFZ: {e}"))?;
        let v: serde_json::Value =
            serde_json::from_slice(&answer.payload).map_err(|e| format!("LEAFZ answer: {e}"))?;
        let leafs = v["data"]["leafs"].as_array().cloned().unwrap_or_default();
        Ok(leafs.iter().filter_map(|l| l["id"].as_u64()).collect())
    })
}

/// Waits until the hub's leaf connections satisfy `want`, through transient monitoring
/// errors; a timeout says what the hub listed last.
fn wait_for_connections(hub: &Side, what: &str, want: impl Fn(&[u64]) -> bool) -> Vec<u64> {
    let last = std::cell::RefCell::new(Err::<Vec<u64>, String>("never asked".into()));
    wait_for_or(
        what,
        Duration::from_secs(60),
        || {
            let now = leaf_connections(hub);
            let done = now.as_deref().is_ok_and(&want);
            *last.borrow_mut() = now;
            done
        },
        || format!("the hub's leaf connections last: {:?}", last.borrow()),
    );
    last.into_inner().unwrap()
}

/// A grant to every agent made after `leaf add` widens what the leaf receives, and its
/// revocation narrows it again, without new credentials: the hub's beat carries the leaf's
/// reads and the leaf's inbox follows.
#[test]
fn a_grant_made_after_the_leaf_was_added_reaches_it_and_its_revocation_or_removal_stops_it() {
    let pair = start_pair();
    append(&pair.hub, "acme", "task:t1", "hub first");
    append(&pair.hub, "acme", "team:platform", "team before the grant");
    wait_for("the link", Duration::from_secs(90), || {
        texts_of(&pair.leaf, "acme").contains("hub first")
    });
    assert!(
        !texts_of(&pair.leaf, "acme").contains("team before the grant"),
        "the leaf received a scope it may not read"
    );

    ok(pair.hub.cli().args([
        "grant",
        "add",
        "--tenant",
        "acme",
        "--agent",
        "*",
        "--scope",
        "team:platform",
    ]));
    // The whole scope comes down, what was written before the grant too.
    append(&pair.hub, "acme", "team:platform", "team after the grant");
    wait_for("the granted scope", Duration::from_secs(60), || {
        let texts = texts_of(&pair.leaf, "acme");
        texts.contains("team before the grant") && texts.contains("team after the grant")
    });

    // The hub closes the leaf's connection when the grant goes (the server fixed its
    // permissions when it connected): a new connection id afterwards.
    let before = wait_for_connections(&pair.hub, "one leaf connection", |ids| ids.len() == 1)[0];
    ok(pair.hub.cli().args([
        "grant",
        "revoke",
        "--tenant",
        "acme",
        "--agent",
        "*",
        "--scope",
        "team:platform",
    ]));
    // The old connection gone and one new in its place.
    wait_for_connections(&pair.hub, "the leaf to connect again", |ids| {
        ids.len() == 1 && ids[0] != before
    });
    // Once the leaf's inbox has dropped the source (its stream's sources say so), the
    // scope's new events stay on the hub while the task's still come down.
    let inbox_sources = || -> Vec<String> {
        let out = ok(pair.leaf.cli().args(["--json", "leaf", "status"]));
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        v["inbox_filters"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|f| f.as_str().unwrap_or("").to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    wait_for(
        "the leaf to drop the revoked scope",
        Duration::from_secs(60),
        || {
            let filters = inbox_sources();
            !filters.is_empty() && !filters.iter().any(|f| f.contains(".team.platform."))
        },
    );
    append(
        &pair.hub,
        "acme",
        "team:platform",
        "team after the revocation",
    );
    append(&pair.hub, "acme", "task:t1", "task after the revocation");
    wait_for("the task's event", Duration::from_secs(60), || {
        texts_of(&pair.leaf, "acme").contains("task after the revocation")
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !texts_of(&pair.leaf, "acme").contains("team after the revocation"),
        "a revoked grant still reaches the leaf"
    );
    let (counts, _) = stored(&pair.leaf, "acme");
    assert!(
        counts.values().all(|&n| n == 1),
        "the leaf stores an event twice"
    );

    // A hostile leaf asks for the revoked scope anyway, over its new connection: the hub
    // refuses it, while the control fills.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let js = admin_js(&pair.leaf).await;
        source_from_hub(
            &js,
            "STEAL",
            "ENGRAM_EVENTS",
            "engram.evt.acme.team.platform.*.*",
        )
        .await;
        source_from_hub(
            &js,
            "CONTROL",
            "ENGRAM_EVENTS",
            "engram.evt.acme.task.*.*.*",
        )
        .await;
        until_filled(&js, "CONTROL").await;
        assert_eq!(
            messages_in(&js, "STEAL").await,
            0,
            "a revoked grant's scope reaches the leaf"
        );
    });

    // A leaf removed loses its connection at once, and cannot make another.
    ok(pair
        .hub
        .cli()
        .args(["leaf", "remove", "laptop", "--tenant", "acme"]));
    wait_for_connections(
        &pair.hub,
        "the removed leaf's connection to close",
        <[u64]>::is_empty,
    );
    std::thread::sleep(Duration::from_secs(5));
    let after = wait_for_connections(&pair.hub, "the hub to list its leafs", |_| true);
    assert!(
        after.is_empty(),
        "a removed leaf connected again: {after:?}"
    );
}

/// The hub's working memory of the scopes a leaf may read comes down into the leaf's
/// bucket (where `engram session resume` reads it); another scope's and another tenant's
/// never do.
#[test]
fn the_hubs_working_memory_of_the_leafs_scopes_comes_down_and_no_other() {
    let pair = start_linked_pair();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (hub, leaf) = rt.block_on(async {
        let bucket = |js: async_nats::jetstream::Context| async move {
            js.get_key_value("engram_working").await.unwrap()
        };
        (
            bucket(admin_js(&pair.hub).await).await,
            bucket(admin_js(&pair.leaf).await).await,
        )
    });
    let get = |key: &str| -> Option<String> {
        rt.block_on(leaf.get(key))
            .unwrap()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    };
    rt.block_on(async {
        for (key, value) in [
            ("acme.session.s1.plan", "step 2 of 5"),
            ("acme.team.platform.secret", "not the leaf's"),
            ("beta.session.s1.plan", "another tenant's"),
        ] {
            hub.put(key, value.to_owned().into()).await.unwrap();
        }
    });
    wait_for("the session's entry", Duration::from_secs(60), || {
        get("acme.session.s1.plan").as_deref() == Some("step 2 of 5")
    });
    // An entry changed on the hub changes on the leaf; the control comes after the others.
    rt.block_on(hub.put("acme.session.s1.plan", "step 3 of 5".to_owned().into()))
        .unwrap();
    rt.block_on(hub.put("acme.task.t1.control", "last".to_owned().into()))
        .unwrap();
    wait_for("the control entry", Duration::from_secs(60), || {
        get("acme.task.t1.control").is_some()
    });
    assert_eq!(get("acme.session.s1.plan").as_deref(), Some("step 3 of 5"));
    assert_eq!(
        get("acme.team.platform.secret"),
        None,
        "an unreadable scope's entry came down"
    );
    assert_eq!(
        get("beta.session.s1.plan"),
        None,
        "another tenant's entry came down"
    );
}

/// `engram run` on the leaf, as a user would on the laptop: the session's records reach the
/// hub, and its artifact (stored in the leaf's own bucket, which the hub sources) comes with
/// it, so `engram session resume` on the hub fetches it and checks its hash.
#[test]
fn a_session_run_on_the_leaf_resumes_on_the_hub_with_its_artifacts() {
    let pair = start_linked_pair();
    let work = tempfile::tempdir().unwrap();
    // The programs' own `engram` calls find the binary under test.
    let path = common::path_with_engram();
    let program = r#"printf 'leaf result 42' > result.txt && engram session artifact result.txt >/dev/null && engram session checkpoint --note "built on the laptop" >/dev/null"#;
    let out = pair
        .leaf
        .cli()
        .args([
            "run", "--tenant", "acme", "--task", "t7", "--role", "coder", "--", "sh", "-c", program,
        ])
        .current_dir(work.path())
        .env("PATH", &path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "engram run on the leaf failed: {stderr}"
    );
    let session = stderr
        .lines()
        .find_map(|l| l.strip_prefix("engram run: session "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no session in {stderr}"))
        .to_owned();

    // On the hub: the session, ended, with its checkpoint.
    wait_for(
        "the session's records on the hub",
        Duration::from_secs(60),
        || {
            json_lines(
                &pair.hub,
                &["session", "list", "--tenant", "acme", "--task", "t7"],
            )
            .iter()
            .flat_map(|v| v.as_array().cloned().unwrap_or_else(|| vec![v.clone()]))
            .any(|s| {
                s["session"] == session.as_str()
                    && s["state"] == "exited"
                    && s["last_checkpoint"] == "built on the laptop"
            })
        },
    );
    // And its artifact, fetched from the hub's copy of the leaf's bucket and checked.
    let into = work.path().join("resumed");
    let mut resumed = None;
    wait_for("the artifact on the hub", Duration::from_secs(60), || {
        let out = pair
            .hub
            .cli()
            .args([
                "--json",
                "session",
                "resume",
                &session,
                "--tenant",
                "acme",
                "--task",
                "t7",
                "--require-artifacts",
                "--into",
                into.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        if out.status.success() {
            resumed = Some(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        out.status.success()
    });
    let resumed: serde_json::Value = serde_json::from_str(resumed.unwrap().trim()).unwrap();
    let artifact = &resumed["artifacts"][0];
    assert_eq!(artifact["status"], "fetched", "{resumed}");
    assert_eq!(
        std::fs::read_to_string(artifact["path"].as_str().unwrap()).unwrap(),
        "leaf result 42"
    );
}
