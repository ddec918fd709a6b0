//! The memory inspector in a real headless browser: Debian's Chromium driven through
//! chromedriver, against a secured server, the services and the gateway. The page reads what
//! an agent remembered with the API key pasted into it, and nothing else.
//!
//! `chromedriver` and `chromium` (or `chromium-browser`) are looked up on `PATH`. Without
//! them the test writes a SKIPPED line straight to the terminal (past the test harness's
//! capture, so a plain `cargo test` shows it) and passes, unless `ENGRAM_REQUIRE_BROWSER=1`
//! (CI sets it), which makes it fail. With `ENGRAM_SCREENSHOTS=1` it saves screenshots
//! of the main sections to `docs/inspector/`.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use engram_docs::{TaskBoard, TaskItem};
use engram_gateway::GatewayConfig;
use engram_testkit::{SecureNats, TestNats};
use engram_tests::{Engram, embedder};
use fantoccini::elements::Element;
use fantoccini::{Client, ClientBuilder, Locator};
use futures::FutureExt;
use serde_json::{Value, json};

/// The names the browser and its driver go by on `PATH` (Debian's, then Ubuntu's).
const CHROMEDRIVER: &[&str] = &["chromedriver"];
const CHROMIUM: &[&str] = &["chromium", "chromium-browser"];
/// How long a DOM condition may take: the page waits on the services, which wait on the
/// projectors.
const WAIT: Duration = Duration::from_secs(20);

async fn post(base: &str, path: &str, key: &str, body: &Value) -> Value {
    let (status, body) = engram_tests::post_json(base, path, key, body).await;
    assert!((200..300).contains(&status), "{path}: {status} {body}");
    body
}

fn task(id: &str) -> Value {
    json!({"kind": "task", "id": id})
}

fn memory(scope: &str, kind: &str, text: &str, importance: f64) -> Value {
    json!({
        "scope": task(scope),
        "layer": "episodic",
        "kind": kind,
        "importance": importance,
        "tags": ["web"],
        "content": {"text": text},
        "embedding": {"model": engram_tests::embedder_model(), "vector": embedder().embed_one(text)},
    })
}

fn fact(subject: &str, predicate: &str, object: &str) -> Value {
    json!({
        "scope": task("fix-login"),
        "layer": "semantic",
        "kind": "fact_asserted",
        "content": {"text": "", "data": {"subject": subject, "predicate": predicate, "object": object}},
    })
}

/// What the agent `web` of `acme` remembers: memories in two tasks, a fact that changed, a
/// skill, a task board two instances edited at once, a snapshot and a dead letter.
async fn remember(nats: &SecureNats, base: &str, key: &str, engram: &Engram) {
    let mut events = vec![
        memory(
            "fix-login",
            "observation",
            "login fails with a 500 after the deploy",
            0.8,
        ),
        memory(
            "fix-login",
            "action",
            "rolled back the session cookie change",
            0.5,
        ),
        memory(
            "fix-login",
            "outcome",
            "login works again; the cookie domain was wrong",
            0.9,
        ),
        memory(
            "fix-login",
            "observation",
            "the checkout page times out under load",
            0.3,
        ),
        memory(
            "fix-login",
            "preference",
            "the team prefers small reversible deploys",
            0.6,
        ),
        fact("db", "runs", "postgres 15"),
    ];
    // More than a page (25) in one scope, to page through.
    for i in 0..30 {
        events.push(memory(
            "release",
            "observation",
            &format!("release note {i}: search got faster"),
            0.4,
        ));
    }
    post(base, "/v1/events", key, &json!(events)).await;
    // Later knowledge: the database was upgraded, so the first value is superseded.
    post(
        base,
        "/v1/events",
        key,
        &json!([
            fact("db", "runs", "postgres 16"),
            fact("login", "served_by", "auth-svc"),
            {
                "scope": task("fix-login"),
                "layer": "procedural",
                "kind": "skill_recorded",
                "content": {"text": "", "data": {
                    "name": "roll-back-a-deploy",
                    "description": "undo the last deploy when logins fail",
                    "steps": ["find the last release", "run the rollback job", "check logins"],
                }},
            },
        ]),
    )
    .await;

    // The team's knowledge, which the key reads through its grant.
    let team = engram_schema::Scope::new(engram_schema::ScopeKind::Team, "core").unwrap();
    for event in [
        engram_tests::fact("acme", team.clone(), "deploys", "happen_on", "tuesdays"),
        engram_tests::embedded(
            "acme",
            team,
            "lead",
            "login incidents go to the auth on-call",
        ),
    ] {
        engram.client.append(&event).await.unwrap();
    }

    // A task board two instances edit at once: both values of the owner are kept.
    let scope = engram_schema::Scope::new(engram_schema::ScopeKind::Task, "fix-login").unwrap();
    let lead = engram.client.agent("acme", "lead", "i-lead").unwrap();
    let mut board = lead
        .open_doc::<TaskBoard>(scope.clone(), "sprint", None)
        .await
        .unwrap();
    board
        .edit(|b| {
            b.items.insert(
                "t-7".into(),
                TaskItem {
                    title: "fix login".into(),
                    ..Default::default()
                },
            );
        })
        .unwrap();
    let created = board.push().await.unwrap().unwrap().seq;
    // Both open the board before either pushes, so neither edit sees the other.
    let mut copies = Vec::new();
    for (instance, owner) in [("i-1", "alice"), ("i-2", "bob")] {
        let agent = engram.client.agent("acme", "worker", instance).unwrap();
        let mut copy = agent
            .open_doc::<TaskBoard>(scope.clone(), "sprint", Some(created))
            .await
            .unwrap();
        copy.edit(|b| b.items.get_mut("t-7").unwrap().owner = Some(owner.into()))
            .unwrap();
        copies.push(copy);
    }
    let mut last = created;
    for mut copy in copies {
        last = copy.push().await.unwrap().unwrap().seq;
    }
    // Read-your-writes: the page is opened once every read model holds all of it.
    let consistency = json!({"scope": task("fix-login"), "min_seq": last, "wait_ms": 15000});
    let mut retrieve = consistency.clone();
    retrieve["query"] = "login".into();
    retrieve["mode"] = "keyword".into();
    post(base, "/v1/retrieve", key, &retrieve).await;
    post(base, "/v1/facts", key, &consistency).await;
    let mut skills = consistency.clone();
    skills["name"] = "roll-back-a-deploy".into();
    post(base, "/v1/skills", key, &skills).await;
    let mut docs = consistency.clone();
    docs["read"] = "list".into();
    post(base, "/v1/docs", key, &docs).await;

    // An operator's labelled cut, and a raw publish no projector can decode.
    engram
        .client
        .snapshot(
            &engram_memory::proto::ScopeRequest {
                tenant: engram_schema::Ident::parse("t", "acme").unwrap(),
                scope: "task:fix-login".parse().unwrap(),
                grants: Vec::new(),
            },
            Some("before-upgrade"),
        )
        .await
        .unwrap();
    let js = async_nats::jetstream::new(nats.admin.client().clone());
    js.publish(
        "engram.evt.acme.task.release.episodic",
        "not an event".into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    engram_testkit::wait_dead_lettered(&nats.admin, &["vector", "keyword", "facts", "skills"], 1)
        .await;
}

/// The first executable file named one of `names` in a directory of `PATH`, as `which` finds it.
fn on_path(names: &[&str]) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| names.iter().map(move |name| dir.join(name)))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// chromedriver on a free loopback port, killed on drop.
struct Driver {
    child: Child,
    port: u16,
    /// The Chromium each session runs.
    chromium: PathBuf,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    async fn start(chromedriver: &Path, chromium: PathBuf) -> Driver {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        engram_testkit::wait_until("chromedriver to listen", WAIT, || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        Driver {
            child,
            port,
            chromium,
        }
    }

    /// A fresh headless Chromium with a profile of its own.
    async fn browser(&self, profile: &Path) -> Client {
        let capabilities = json!({
            "goog:chromeOptions": {
                "binary": self.chromium,
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    // Without these Chromium keeps calling home, which the closed network
                    // answers with a flood of failures.
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--window-size=1360,1000",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }
        });
        let Value::Object(capabilities) = capabilities else {
            unreachable!()
        };
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("chromedriver opens a session")
    }
}

/// An element matching `xpath`, once the page shows one.
async fn wait_for(browser: &Client, what: &str, xpath: &str) -> Element {
    match browser
        .wait()
        .at_most(WAIT)
        .for_element(Locator::XPath(xpath))
        .await
    {
        Ok(element) => element,
        Err(e) => {
            let text = match browser.find(Locator::Css("body")).await {
                Ok(body) => body.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            panic!("{what}: {e}\n--- the page shows:\n{text}");
        }
    }
}

/// The text of the element at `xpath` once it is there. The page re-renders its tables as
/// answers arrive, so an element found a moment ago may be gone (stale): it is then found
/// again, for as long as [`WAIT`].
async fn text_of(browser: &Client, what: &str, xpath: &str) -> String {
    let started = std::time::Instant::now();
    loop {
        let element = wait_for(browser, what, xpath).await;
        match element.text().await {
            Ok(text) => return text,
            Err(e) if started.elapsed() < WAIT => {
                note_retry(what, &e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Says on stderr why a read is tried again (the test's output shows it on failure).
fn note_retry(what: &str, e: &dyn std::fmt::Display) {
    eprintln!("{what}: reading again after: {e}");
}

/// An XPath literal for `text` (no quotes in the texts used here).
fn has_text(text: &str) -> String {
    format!("contains(normalize-space(.), '{text}')")
}

/// Clicks the element at `xpath` once it is there, finding it again if the page replaced it
/// in between (see [`text_of`]).
async fn click(browser: &Client, xpath: &str) {
    let started = std::time::Instant::now();
    loop {
        match wait_for(browser, xpath, xpath).await.click().await {
            Ok(_) => return,
            Err(e) if started.elapsed() < WAIT => {
                note_retry(xpath, &e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{xpath}: {e}"),
        }
    }
}

async fn fill(browser: &Client, css: &str, text: &str) {
    let input = browser.find(Locator::Css(css)).await.unwrap();
    input.clear().await.unwrap();
    input.send_keys(text).await.unwrap();
}

async fn section(browser: &Client, name: &str) {
    click(browser, &format!("//nav//button[@data-section='{name}']")).await;
    wait_for(
        browser,
        &format!("section {name} to show"),
        &format!("//section[@id='section-{name}' and not(@hidden)]"),
    )
    .await;
}

/// Saves a screenshot of the page as `docs/inspector/<name>.png` when asked to.
async fn screenshot(browser: &Client, name: &str) {
    if std::env::var("ENGRAM_SCREENSHOTS").as_deref() != Ok("1") {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/inspector");
    std::fs::create_dir_all(&dir).unwrap();
    let png = browser.screenshot().await.unwrap();
    std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_inspector_shows_what_a_key_may_read() {
    let (chromedriver, chromium) = match (on_path(CHROMEDRIVER), on_path(CHROMIUM)) {
        (Some(chromedriver), Some(chromium)) => (chromedriver, chromium),
        (chromedriver, chromium) => {
            let missing = [("chromedriver", chromedriver), ("chromium", chromium)]
                .into_iter()
                .filter(|(_, found)| found.is_none())
                .map(|(name, _)| name)
                .collect::<Vec<_>>()
                .join(" and ");
            let missing = format!("{missing} not found on PATH");
            assert!(
                std::env::var("ENGRAM_REQUIRE_BROWSER").as_deref() != Ok("1"),
                "ENGRAM_REQUIRE_BROWSER=1 but {missing}: apt-get install chromium chromium-driver"
            );
            // Straight to the process's stderr: `eprintln!` would be captured by the test
            // harness and shown only on failure, so a plain `cargo test` would hide the skip.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "\n!!! SKIPPED the inspector browser test: {missing} \
             (apt-get install chromium chromium-driver; ENGRAM_REQUIRE_BROWSER=1 makes this fail)\n"
            );
            return;
        }
    };
    let nats = TestNats::start_secured().await;
    let engram = Engram::start_secured(&nats).await;
    nats.add_tenant("acme").await;
    let key = nats.add_agent("acme", "web", &[]).await.api_key().unwrap();
    // Read-only access to the team's memory, once the query service knows of it.
    nats.append_record(engram_access::Record::GrantAdded {
        tenant: engram_schema::Ident::parse("t", "acme").unwrap(),
        to: "web".parse().unwrap(),
        scope: "team:core".parse().unwrap(),
    })
    .await;
    let base = engram_tests::serve_http(&nats, GatewayConfig::default()).await;
    engram_testkit::wait_until("the grant to be in force", WAIT, || {
        let (base, key) = (base.clone(), key.clone());
        async move {
            let response = reqwest::Client::new()
                .get(format!("{base}/v1/whoami"))
                .bearer_auth(&key)
                .send()
                .await
                .unwrap();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            body["grants"].to_string().contains("team:core")
        }
    })
    .await;
    remember(&nats, &base, &key, &engram).await;

    let driver = Driver::start(&chromedriver, chromium).await;
    let profile = tempfile::tempdir().unwrap();
    let browser = driver.browser(profile.path()).await;
    // The session is closed (and its Chromium with it) whether the checks pass or not.
    let checked = AssertUnwindSafe(inspect(browser.clone(), &base, &key))
        .catch_unwind()
        .await;
    let _ = browser.close().await;
    if let Err(panic) = checked {
        std::panic::resume_unwind(panic);
    }
}

/// What the test checks on the page, as the user would do it.
async fn inspect(browser: Client, base: &str, key: &str) {
    browser.goto(&format!("{base}/inspector")).await.unwrap();

    // Paste the key: the page says whose it is and lists the scopes it may read.
    fill(&browser, "#key", key).await;
    click(&browser, "//button[@id='connect']").await;
    wait_for(
        &browser,
        "the identity",
        &format!("//*[@id='identity' and {}]", has_text("acme / web")),
    )
    .await;

    // The scopes it may read, with their events; pick one: its timeline holds the
    // memories, newest first.
    section(&browser, "scopes").await;
    let listed = text_of(
        &browser,
        "the scope with its count",
        &format!(
            "//table[@id='scopes-table']/tbody/tr[{}]",
            has_text("task:fix-login")
        ),
    )
    .await;
    // Five memories, three facts, a skill and three document changes, by layer.
    for count in [
        "task:fix-login 12",
        "episodic 5",
        "semantic 3",
        "procedural 1",
        "working 3",
    ] {
        assert!(listed.contains(count), "{count}: {listed}");
    }
    wait_for(
        &browser,
        "the other scope",
        &format!(
            "//table[@id='scopes-table']/tbody/tr[{}]",
            has_text("task:release")
        ),
    )
    .await;
    screenshot(&browser, "scopes").await;
    click(
        &browser,
        &format!(
            "//table[@id='scopes-table']/tbody/tr[{}]//button",
            has_text("task:fix-login")
        ),
    )
    .await;
    wait_for(
        &browser,
        "the timeline to open",
        "//section[@id='section-timeline' and not(@hidden)]",
    )
    .await;
    let row = "//table[@id='timeline-table']/tbody/tr";
    wait_for(
        &browser,
        "the timeline to show the memories",
        &format!(
            "{row}[{}]",
            has_text("login fails with a 500 after the deploy")
        ),
    )
    .await;
    let newest = text_of(&browser, "the newest event", &format!("{row}[1]")).await;
    assert!(newest.contains("doc_changed"), "newest first: {newest}");
    screenshot(&browser, "timeline").await;
    browser
        .find(Locator::Css("#timeline-order option[value='stream']"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(
        &browser,
        "stream order, oldest first",
        &format!(
            "{row}[1][{}]",
            has_text("login fails with a 500 after the deploy")
        ),
    )
    .await;

    // Search: the expected memory ranks first, with its score parts.
    section(&browser, "search").await;
    fill(&browser, "#search-query", "login fails").await;
    browser
        .find(Locator::Css("#search-mode option[value='keyword']"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    click(&browser, "//button[@id='search-run']").await;
    let top = text_of(
        &browser,
        "the top result",
        "//table[@id='search-table']/tbody/tr[1][.//*[contains(@class, 'parts')]]",
    )
    .await;
    assert!(
        top.contains("login fails with a 500 after the deploy"),
        "top result: {top}"
    );
    for part in ["keyword", "fused", "recency", "importance"] {
        assert!(top.contains(part), "score part {part} is shown: {top}");
    }
    screenshot(&browser, "search").await;

    // Facts: the current value, and its history on demand.
    section(&browser, "facts").await;
    let fact = "//table[@id='facts-table']/tbody/tr";
    wait_for(
        &browser,
        "the current fact",
        &format!("{fact}[{}][{}]", has_text("runs"), has_text("postgres 16")),
    )
    .await;
    click(
        &browser,
        &format!(
            "{fact}[{}]//button[contains(@class, 'history')]",
            has_text("postgres 16")
        ),
    )
    .await;
    // The team's fact, read through the grant, says where it comes from.
    wait_for(
        &browser,
        "the granted scope's fact",
        &format!(
            "{fact}[{}][{}][{}]",
            has_text("deploys"),
            has_text("tuesdays"),
            has_text("team:core")
        ),
    )
    .await;
    let history = "//table[@id='fact-history-table']/tbody/tr";
    wait_for(
        &browser,
        "the superseded value in the history",
        &format!("{history}[{}]", has_text("postgres 15")),
    )
    .await;
    wait_for(
        &browser,
        "the current value in the history",
        &format!("{history}[{}]", has_text("postgres 16")),
    )
    .await;
    screenshot(&browser, "facts").await;

    // The other sections render what they hold.
    section(&browser, "skills").await;
    wait_for(
        &browser,
        "the skill",
        &format!(
            "//table[@id='skills-table']//td[{}]",
            has_text("roll-back-a-deploy")
        ),
    )
    .await;
    screenshot(&browser, "skills").await;
    section(&browser, "docs").await;
    click(
        &browser,
        &format!(
            "//table[@id='docs-table']/tbody/tr[{}]//button",
            has_text("sprint")
        ),
    )
    .await;
    wait_for(
        &browser,
        "the concurrent owners as a conflict",
        &format!(
            "//table[@id='doc-conflicts-table']/tbody/tr[{}][{}][{}]",
            has_text("/items/t-7/owner"),
            has_text("alice"),
            has_text("bob")
        ),
    )
    .await;
    screenshot(&browser, "docs").await;

    section(&browser, "snapshots").await;
    wait_for(
        &browser,
        "the labelled snapshot",
        &format!(
            "//table[@id='snapshots-table']/tbody/tr[{}]",
            has_text("before-upgrade")
        ),
    )
    .await;
    screenshot(&browser, "snapshots").await;
    section(&browser, "dead-letters").await;
    wait_for(
        &browser,
        "the dead letter",
        &format!(
            "//table[@id='dead-letters-table']/tbody/tr[{}]",
            has_text("task:release")
        ),
    )
    .await;
    screenshot(&browser, "dead-letters").await;

    // Paging through a scope of more than a page, newest first: 30 notes, 25 a page.
    browser
        .find(Locator::Css("#scope-select option[value='task:release']"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    section(&browser, "timeline").await;
    for (css, wanted) in [
        ("#timeline-order option[value='newest']", "release note 29:"),
        ("#timeline-size option[value='25']", "release note 29:"),
    ] {
        browser
            .find(Locator::Css(css))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        wait_for(&browser, wanted, &format!("{row}[1][{}]", has_text(wanted))).await;
    }
    wait_for(
        &browser,
        "a full first page",
        &format!("{row}[25][{}]", has_text("release note 5:")),
    )
    .await;
    click(&browser, "//button[@id='timeline-next' and not(@disabled)]").await;
    wait_for(
        &browser,
        "the older page",
        &format!("{row}[1][{}]", has_text("release note 4:")),
    )
    .await;
    let rows = browser.find_all(Locator::XPath(row)).await.unwrap();
    assert_eq!(rows.len(), 5, "the last page holds the 5 oldest notes");
    click(&browser, "//button[@id='timeline-prev' and not(@disabled)]").await;
    wait_for(
        &browser,
        "back to the newest page",
        &format!("{row}[1][{}]", has_text("release note 29:")),
    )
    .await;

    // A key the server does not know: the API's error, shown.
    fill(&browser, "#key", "egk.acme.web.SUNOTASEED").await;
    click(&browser, "//button[@id='connect']").await;
    wait_for(
        &browser,
        "the unauthenticated error",
        &format!(
            "//*[contains(@class, 'error') and not(@hidden) and {}]",
            has_text("unauthenticated")
        ),
    )
    .await;
    screenshot(&browser, "error").await;
}
