//! `engram up --demo` as a new user first runs it (the README's command: a managed, authenticated
//! nats-server): every section, in order, no warning, and every claim it prints checked against
//! the state it left: the merged board and its conflict, the consolidation's outputs, the
//! snapshots and the bootstrap's tail and hashes, no dead letter, and a key that connects both
//! MCP configurations it prints.

mod common;
use common::{KillOnDrop, http_exchange};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use engram::demo::SECTIONS;
use engram_bus::StoredEvent;
use engram_memory::proto::{
    Consistency, DeadLettersRequest, DocRead, DocRequest, RetrievalMode, RetrieveRequest,
    ScopeRequest, SnapshotsRequest,
};
use engram_schema::{EventKind, Ident, Scope, ScopeKind, SubjectFilter};
use engram_sdk::{Client, StartAt};
use futures::StreamExt;
use rmcp::model::{CallToolRequestParams, ClientConfig};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{ConfigureCommandExt, StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};
use serde_json::Value;

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_the_whole_design_in_order_checks_what_it_prints_and_warns_about_nothing() {
    let home = tempfile::tempdir().unwrap();
    let log = home.path().join("up.log");
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let mut up = KillOnDrop(
        Command::new(ENGRAM)
            .arg("--home")
            .arg(home.path())
            .args(["--log-format", "json"])
            .args(["up", "--nats-port", &lease.port().to_string()])
            .args(["--http", "127.0.0.1:0", "--demo"])
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_HOME")
            .env_remove("ENGRAM_CREDS")
            .env_remove("ENGRAM_API_KEY")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    // Read on a thread, so that a demo that hangs fails the test instead of blocking it.
    let mut stdout = common::Lines::of(up.0.stdout.take().unwrap());
    let ready = stdout
        .until("engram is up", Duration::from_secs(180))
        .unwrap_or_else(|e| panic!("engram up: {e}"));
    let started = Instant::now();
    let (nats, http) = (
        common::token(&ready, "nats=").to_owned(),
        common::token(&ready, "http=http://").to_owned(),
    );
    let finished = stdout.until("engram keeps running", Duration::from_secs(180));
    let took = started.elapsed();
    let printed = stdout.seen().join("\n");
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    if let Err(e) = finished {
        panic!(
            "demo did not finish ({e}); it printed:\n{printed}\nlog:\n{}",
            logs()
        );
    }
    assert!(
        printed.contains("the demo is done") && !logs().contains("demo failed"),
        "the demo failed; it printed:\n{printed}\nlog:\n{}",
        logs()
    );
    eprintln!("the demo took {took:?} after engram was up");

    // Every section, in order
    let mut at = 0;
    let mut starts = Vec::new();
    for section in SECTIONS {
        let found = printed[at..]
            .find(section)
            .unwrap_or_else(|| panic!("no {section:?} after byte {at} in:\n{printed}"));
        starts.push(at + found);
        at += found + section.len();
    }
    let section =
        |i: usize| &printed[starts[i]..starts.get(i + 1).copied().unwrap_or(printed.len())];

    // Retrieval shows its score parts; the facts, the current value and the history
    for part in ["dense ", "bm25 ", "fusion ", "recency +", "importance +"] {
        assert!(printed.contains(part), "no {part:?} in:\n{printed}");
    }
    let facts = section(3);
    assert!(
        facts.contains("parameterised statements") && facts.contains("current"),
        "{facts}"
    );
    assert!(
        facts.contains("string concatenation") && facts.contains("superseded by fact@"),
        "{facts}"
    );
    assert!(printed.contains("duplicate=true"), "{printed}");
    assert!(printed.contains("replayed 7 events"), "{printed}");
    assert!(printed.contains("(expired)"), "{printed}");

    // The state the demo left, read as the admin
    let admin = engram_access::creds::service_path(home.path(), engram_access::RoleName::Admin);
    let client = Client::connect_with_creds(&nats, &admin).await.unwrap();
    let tenant = Ident::parse("tenant", "acme").unwrap();
    let head = client.bus().stream_summary().await.unwrap().last_seq;

    shared_documents(&client, section(6), head).await;
    consolidation(&client, section(7)).await;
    snapshot_and_bootstrap(&client, section(8)).await;

    // No dead letter: printed, and none in the dead-letter stream.
    assert!(section(9).contains("no dead letter"), "{}", section(9));
    let letters = client
        .list_dead_letters(&DeadLettersRequest {
            tenant: tenant.clone(),
            limit: 500,
        })
        .await
        .unwrap();
    assert!(
        letters.dead_letters.is_empty() && letters.total == 0,
        "the demo made dead letters: {letters:#?}"
    );

    next_steps(section(10), &http, home.path()).await;

    // SIGTERM, then: nothing from start to stop was a warning or an error
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(up.0.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while up.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "engram up did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
    let logs = std::fs::read_to_string(&log).unwrap();
    assert!(!logs.contains("demo failed"), "{logs}");
    let before_shutdown = logs
        .lines()
        .take_while(|l| !l.contains("\"shutting down\""))
        .collect::<Vec<_>>();
    assert!(
        before_shutdown.len() < logs.lines().count(),
        "no shutdown line in:\n{logs}"
    );
    // The check reads JSON log lines: make sure that is what they are.
    assert!(
        before_shutdown
            .iter()
            .any(|l| l.contains("\"level\":\"INFO\"")),
        "{logs}"
    );
    let warnings: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("\"level\":\"WARN\"") || l.contains("\"level\":\"ERROR\""))
        .collect();
    assert!(warnings.is_empty(), "the demo logged: {warnings:#?}");
}

/// The number after the first `key` in `text`.
fn num_after(text: &str, key: &str) -> u64 {
    let rest = &text[text
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in {text:?}"))
        + key.len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {key:?} in {text:?}"))
}

/// The word after the first `key` in `text`.
fn word_after<'a>(text: &'a str, key: &str) -> &'a str {
    let rest = &text[text
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in {text:?}"))
        + key.len()..];
    rest.split_whitespace().next().unwrap_or_default()
}

/// The one line of `text` that contains `wanted`.
fn line_with<'a>(text: &'a str, wanted: &str) -> &'a str {
    let found: Vec<&str> = text.lines().filter(|l| l.contains(wanted)).collect();
    assert_eq!(found.len(), 1, "{wanted:?} in:\n{text}");
    found[0]
}

/// Every event of `scope` in the stream, by seq.
async fn events_of(client: &Client, scope: &Scope) -> BTreeMap<u64, StoredEvent> {
    let filter = SubjectFilter::all()
        .tenant(Ident::parse("tenant", "acme").unwrap())
        .scope(scope.kind, scope.id.clone());
    let mut replay = client.replay(&filter, StartAt::Seq(1)).await.unwrap();
    let mut events = BTreeMap::new();
    while let Some(item) = replay.next().await {
        let stored = item.unwrap();
        events.insert(stored.seq, stored);
    }
    events
}

fn scopes(scope: &Scope, grants: Vec<Scope>) -> ScopeRequest {
    ScopeRequest {
        tenant: Ident::parse("tenant", "acme").unwrap(),
        scope: scope.clone(),
        grants,
    }
}

fn at(seq: u64) -> Consistency {
    Consistency {
        min_seq: Some(seq),
        wait_ms: Some(30_000),
    }
}

fn data(e: &StoredEvent) -> &Value {
    e.event.content.data.as_ref().unwrap_or(&Value::Null)
}

fn id_set(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

/// The board every reader printed, its conflict, and the board the document service holds.
async fn shared_documents(client: &Client, text: &str, head: u64) {
    let name = word_after(text, "task_board/");
    let team = Scope::new(ScopeKind::Team, "core").unwrap();
    assert!(text.contains("every reader shows the same board"), "{text}");
    // The board printed: id -> (status, owner).
    let board: BTreeMap<&str, (&str, &str)> = text
        .lines()
        .filter(|l| l.starts_with("    t-"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[0], (w[1], w[2]))
        })
        .collect();
    // What the instances wrote, from their own lines: the items created and added, and the
    // two owners set at the same moment.
    let mut wanted: BTreeSet<String> = ["t-1", "t-2"].map(String::from).into();
    assert!(text.contains("adds t-3"), "{text}");
    wanted.insert("t-3".into());
    assert_eq!(
        board.keys().map(|k| k.to_string()).collect::<BTreeSet<_>>(),
        wanted,
        "{text}"
    );
    let owners_set: BTreeSet<String> = text
        .lines()
        .filter(|l| l.contains("sets t-1 owner=\""))
        .map(|l| {
            word_after(l, "owner=\"")
                .split('"')
                .next()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(owners_set.len(), 2, "{text}");
    let conflict = line_with(text, "conflicts: ");
    let values: Vec<String> = conflict
        .split_once("/items/t-1/owner")
        .unwrap_or_else(|| panic!("no conflict on t-1's owner: {conflict}"))
        .1
        .split_once("(both kept")
        .unwrap()
        .0
        .split('|')
        .map(|v| v.trim().trim_matches('"').to_owned())
        .collect();
    assert_eq!(
        values.iter().cloned().collect::<BTreeSet<_>>(),
        owners_set,
        "the conflict does not hold both owners: {conflict}"
    );
    assert_eq!(
        board["t-1"].1, values[0],
        "the winner printed first is not the owner the board shows: {text}"
    );
    assert_eq!(board["t-2"].1, "i-1", "the offline edit is missing: {text}");

    // The document service's board now (the bootstrap step marked t-1 done since).
    let served = client
        .doc(&DocRequest {
            scopes: scopes(&team, Vec::new()),
            read: DocRead::State,
            doc_type: Some(Ident::parse("doc_type", "task_board").unwrap()),
            name: Some(Ident::parse("name", name).unwrap()),
            include_bytes: false,
            include_values: false,
            limit: 1,
            consistency: at(head),
        })
        .await
        .unwrap();
    let value = served.doc.as_ref().unwrap().value.clone().unwrap();
    assert_eq!(served.conflicts.len(), 1, "{:?}", served.conflicts);
    assert_eq!(served.conflicts[0].path, "/items/t-1/owner");
    assert_eq!(
        served.conflicts[0].values,
        values
            .iter()
            .map(|v| Value::from(v.as_str()))
            .collect::<Vec<_>>(),
        "the service's conflict differs from the printed one"
    );
    let items = value["items"].as_object().unwrap();
    assert_eq!(items.len(), board.len(), "{value}");
    for (id, (status, owner)) in &board {
        let item = &items[*id];
        let shown_owner = item["owner"].as_str().unwrap_or("-");
        assert_eq!(shown_owner, *owner, "{id}: {value}");
        let now = item["status"].as_str().unwrap();
        if *id == "t-1" {
            assert_eq!(now, "done", "{value}");
        } else {
            assert_eq!(now, *status, "{id}: {value}");
        }
    }
}

/// The consolidation's outputs as printed, against the session's events in the stream.
async fn consolidation(client: &Client, text: &str) {
    let session: Scope = word_after(text, " in ")
        .trim_end_matches(',')
        .parse()
        .unwrap();
    assert_eq!(session.kind, ScopeKind::Session);
    let events = events_of(client, &session).await;
    let tellings: Vec<u64> = text
        .lines()
        .filter(|l| l.contains(" observation "))
        .map(|l| num_after(l, "seq="))
        .collect();
    assert!(tellings.len() > 1, "{text}");
    let telling_ids: BTreeSet<String> = tellings
        .iter()
        .map(|s| events[s].event.event_id.to_string())
        .collect();
    let merged = &events[&num_after(line_with(text, "    merged "), "seq=")];
    let sources = line_with(text, "sources: ");
    let printed_sources: BTreeSet<u64> = sources
        .split("seq ")
        .skip(1)
        .map(|s| num_after(s, ""))
        .collect();
    assert_eq!(
        printed_sources,
        tellings.iter().copied().collect(),
        "{text}"
    );
    assert_eq!(num_after(sources, "recurrences "), tellings.len() as u64);
    assert_eq!(merged.event.kind, EventKind::Consolidated);
    assert_eq!(data(merged)["op"], "merged");
    assert_eq!(id_set(&data(merged)["sources"]), telling_ids);
    assert_eq!(data(merged)["recurrences"], tellings.len() as u64);
    let superseded = &events[&num_after(line_with(text, "    superseded "), "seq=")];
    assert_eq!(superseded.event.kind, EventKind::Forgotten);
    assert_eq!(id_set(&data(superseded)["event_ids"]), telling_ids);
    assert_eq!(
        data(superseded)["superseded_by"],
        merged.event.event_id.as_str()
    );
    let summary = &events[&num_after(line_with(text, "    summary "), "seq=")];
    assert_eq!(data(summary)["op"], "summary");
    assert!(
        telling_ids.is_subset(&id_set(&data(summary)["sources"])),
        "{summary:?}"
    );
    // Superseded, not deleted: every telling is still in the log.
    for seq in &tellings {
        assert!(events.contains_key(seq), "telling {seq} was deleted");
    }
    // The restored one: a copy naming it, retrieved again; the other tellings stay hidden.
    let restore = line_with(text, "--restore ");
    let restored_id = word_after(restore, "--restore ");
    let original = &events[&num_after(restore, "'s seq ")];
    assert_eq!(original.event.event_id.as_str(), restored_id);
    let copy = &events[&num_after(restore, "-> seq=")];
    assert_eq!(data(copy)["op"], "restored");
    assert_eq!(
        copy.event.causation_id.as_ref().map(|c| c.as_str()),
        Some(restored_id)
    );
    let last = *events.keys().max().unwrap();
    let found = client
        .retrieve(&RetrieveRequest {
            scopes: scopes(&session, Vec::new()),
            query: original.event.content.text.clone(),
            vector: None,
            top_k: 20,
            filter: Default::default(),
            consistency: at(last),
            mode: RetrievalMode::Keyword,
            ranking: None,
        })
        .await
        .unwrap();
    let returned: BTreeSet<String> = found
        .results
        .iter()
        .map(|r| r.event_id.to_string())
        .collect();
    assert!(
        returned.contains(merged.event.event_id.as_str())
            && returned.contains(copy.event.event_id.as_str())
            && returned.is_disjoint(&telling_ids),
        "{returned:?}"
    );
}

/// The snapshots the bootstrap used were cut, its tail is the scopes' events after them, and
/// the hashes it printed are equal.
async fn snapshot_and_bootstrap(client: &Client, text: &str) {
    let versions = |line: &str| -> Vec<(String, u64)> {
        ["facts", "skills", "docs"]
            .iter()
            .map(|m| ((*m).to_owned(), num_after(line, &format!("{m} v"))))
            .collect()
    };
    let cut = versions(line_with(text, "snapshot cut of every read model"));
    let booted = line_with(text, "  bootstrap: ");
    assert_eq!(versions(booted), cut, "{text}");
    let hashes = line_with(text, "state hash at seq ");
    let (ours, full) = (
        word_after(hashes, "bootstrap "),
        word_after(hashes, "full replay "),
    );
    assert!(ours.len() == 16 && ours == full, "{hashes}");
    // The snapshots are in the index.
    let listed = client
        .list_snapshots(&SnapshotsRequest { projector: None })
        .await
        .unwrap();
    for (model, version) in &cut {
        assert!(
            listed
                .snapshots
                .iter()
                // Each partition's instance of the model has its own: `facts-p3`.
                .any(|s| s["projector"]
                    .as_str()
                    .is_some_and(|p| p.starts_with(&format!("{model}-p")))
                    && s["version"] == *version),
            "no {model} snapshot v{version} in {listed:?}"
        );
    }
    // The tail: each scope's events after its partition's snapshot (the newest of its
    // partition at or below the set's version), up to the seq it read to; the two events
    // appended after the cut are among them.
    let through = num_after(hashes, "state hash at seq ");
    let set = cut.iter().map(|(_, v)| *v).max().unwrap();
    let task = Scope::new(ScopeKind::Task, "fix-login-bug").unwrap();
    let team = Scope::new(ScopeKind::Team, "core").unwrap();
    let mut tail = BTreeSet::new();
    for scope in [&task, &team] {
        let key = engram_memory::ScopeKey::new(
            engram_schema::Ident::parse("tenant", "acme").unwrap(),
            scope.clone(),
        );
        let instance = engram_memory::proto::instance_name(
            "facts",
            key.partition(engram_schema::DEFAULT_PARTITIONS),
        );
        let from = listed
            .snapshots
            .iter()
            .filter(|s| s["projector"] == instance.as_str())
            .filter_map(|s| s["version"].as_u64())
            .filter(|v| *v <= set)
            .max()
            .unwrap_or_else(|| panic!("no {instance} snapshot in {listed:?}"));
        tail.extend(
            events_of(client, scope)
                .await
                .into_keys()
                .filter(|s| *s > from && *s <= through),
        );
    }
    assert_eq!(num_after(booted, "replayed "), tail.len() as u64, "{text}");
    let then = line_with(text, "then: ");
    let appended: Vec<u64> = then
        .split("seq=")
        .skip(1)
        .map(|s| num_after(s, ""))
        .collect();
    assert_eq!(appended.len(), 2, "{then}");
    for seq in appended {
        assert!(tail.contains(&seq), "{seq} is not in the tail {tail:?}");
    }
    // Bootstrapping again from those snapshots reaches a full replay's state.
    let request = scopes(&task, vec![team]);
    let newest = cut.iter().map(|(_, v)| *v).max();
    // (Both read to the stream's end: an event between them, a usage report say, means
    // reading both again.)
    for attempt in 1.. {
        let again = client.bootstrap_with(&request, newest, 0).await.unwrap();
        let replayed = client.replay_scope(&request).await.unwrap();
        if again.memory.through != replayed.through && attempt < 3 {
            continue;
        }
        let used: Vec<(String, u64)> = again
            .snapshots
            .iter()
            .map(|(m, s)| (m.clone(), s.as_ref().expect("a snapshot").version))
            .collect();
        assert_eq!(used, cut);
        assert_eq!(again.memory.through, replayed.through);
        assert_eq!(again.memory.state_hash(), replayed.state_hash());
        break;
    }
}

/// The key works on the address printed, and both harness configurations printed connect.
async fn next_steps(text: &str, http: &str, home: &std::path::Path) {
    let key = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("egk."))
        .unwrap_or_else(|| panic!("no key in {text}"))
        .to_owned();
    let (status, body) = http_exchange(
        http,
        http,
        &format!("GET /v1/whoami HTTP/1.1\r\nAuthorization: Bearer {key}"),
        "",
    );
    assert_eq!(status, 200, "{body}");
    let me: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (me["tenant"].as_str(), me["agent"].as_str()),
        (Some("acme"), Some("coder"))
    );

    // Claude Code's command, over HTTP.
    let claude = line_with(text, "claude mcp add --transport http engram ");
    let url = word_after(claude, " engram ");
    assert_eq!(url, format!("http://{http}/mcp"));
    let header = |name: &str| -> String {
        claude
            .split('"')
            .find_map(|h| h.strip_prefix(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no {name} header in {claude}"))
            .to_owned()
    };
    assert_eq!(header("Authorization"), format!("Bearer {key}"));
    let scope = header("Engram-Scope");
    let config = StreamableHttpClientTransportConfig::with_uri(url)
        .auth_header(key.clone())
        .custom_headers(HashMap::from([(
            "engram-scope".parse().unwrap(),
            scope.parse().unwrap(),
        )]));
    let over_http = ClientConfig::default()
        .serve(StreamableHttpClientTransport::from_config(config))
        .await
        .unwrap();
    recalls_the_demo(&over_http, "http").await;
    over_http.cancel().await.unwrap();

    // Cursor's mcp.json, over stdio: the command, args and env exactly as printed.
    let cursor = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("{ \"mcpServers\""))
        .unwrap_or_else(|| panic!("no mcp.json in {text}"));
    let cursor: Value = serde_json::from_str(cursor).unwrap();
    let server = &cursor["mcpServers"]["engram"];
    let args: Vec<String> = server["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(server["env"]["ENGRAM_API_KEY"], key.as_str());
    let command =
        tokio::process::Command::new(server["command"].as_str().unwrap()).configure(|c| {
            c.args(&args)
                .env("ENGRAM_API_KEY", &key)
                .env("ENGRAM_HOME", home)
                .env_remove("ENGRAM_CONFIG")
                .env_remove("ENGRAM_CREDS");
        });
    let over_stdio = ClientConfig::default()
        .serve(TokioChildProcess::new(command).unwrap())
        .await
        .unwrap();
    recalls_the_demo(&over_stdio, "stdio").await;
    over_stdio.cancel().await.unwrap();

    // The inspector, and the Python client's install.
    let inspector = word_after(line_with(text, "the memory inspector"), "http://");
    let (host, path) = inspector.split_once('/').unwrap();
    assert_eq!(host, http);
    let (status, page) = http_exchange(http, http, &format!("GET /{path} HTTP/1.1"), "");
    assert!(status == 200 && page.contains("<html"), "{status}");
    assert!(text.contains("pip install ./clients/python"), "{text}");
    let pyproject = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../clients/python/pyproject.toml");
    let pyproject = std::fs::read_to_string(&pyproject).unwrap();
    assert!(
        pyproject.contains("name = \"engram-client\""),
        "{pyproject}"
    );
}

/// The harness sees Engram's tools, and recall finds the demo's first observation.
async fn recalls_the_demo(client: &RunningService<RoleClient, ClientConfig>, label: &str) {
    let tools = client.list_all_tools().await.unwrap();
    assert!(
        tools.iter().any(|t| t.name == "task_board") && tools.iter().any(|t| t.name == "recall"),
        "{label}: {tools:?}"
    );
    let args = serde_json::json!({"query": "why does login fail when the password has a quote"});
    let result = client
        .call_tool(
            CallToolRequestParams::new("recall").with_arguments(args.as_object().unwrap().clone()),
        )
        .await
        .unwrap();
    assert_ne!(result.is_error, Some(true), "{label}: {result:?}");
    let text = format!("{result:?}");
    assert!(
        text.contains("password contains a quote"),
        "{label}: recall did not find the demo's memory: {text}"
    );
}
