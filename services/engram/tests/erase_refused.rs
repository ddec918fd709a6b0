//! `engram erase` against an events stream an older engram created with `deny_delete` and
//! `deny_purge`: refused with the README's reason, exit 1, and nothing changed (no audit
//! record, no event gone); and `engram up` on that stream says so at start-up.

mod common;

use std::time::Duration;

use common::{KillOnDrop, Lines, cli};
use engram_testkit::TestNats;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erase_refuses_a_stream_that_denies_deletes_and_purges_and_changes_nothing() {
    let nats = TestNats::start_secured().await;
    nats.add_tenant("acme").await;
    let bus = &nats.admin;
    for text in ["u1 pays by card", "u1 lives in Lisbon"] {
        let mut event = engram_testkit::event("acme", "ignored", text);
        event.scope = "user:u1".parse().unwrap();
        bus.append(&event, Default::default()).await.unwrap();
    }
    let name = bus.config().stream.name.clone();
    engram_testkit::deny_erasure(bus, true, true).await;
    let (records, messages) = (
        nats.registry_last_seq().await,
        bus.stream_summary().await.unwrap().messages,
    );

    // As an operator runs it on the machine of `engram up`: the admin's credentials in home.
    let home = nats.home.clone();
    let url = nats.url();
    let out = tokio::task::spawn_blocking(move || {
        cli(&home)
            .args(["--nats", &url, "erase", "--tenant", "acme", "--user", "u1"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("denies purges or deletes") && stderr.contains("nothing was changed"),
        "{stderr}"
    );
    assert!(stderr.contains(&name), "{stderr}");
    assert_eq!(
        nats.registry_last_seq().await,
        records,
        "an audit record was appended"
    );
    assert_eq!(bus.stream_summary().await.unwrap().messages, messages);

    // `engram up` on such a stream keeps working, and warns at start-up that erasure cannot.
    let home = nats.home.clone();
    let url = nats.url();
    let warned = tokio::task::spawn_blocking(move || {
        let mut up = KillOnDrop(
            cli(&home)
                .args(["--nats", &url, "up", "--log-format", "json"])
                .args(["--http", "127.0.0.1:0"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut lines = Lines::of(up.0.stderr.take().unwrap());
        lines
            .until("cannot delete events from it", Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("{e}:\n{}", lines.seen().join("\n")))
    })
    .await
    .unwrap();
    assert!(
        warned.contains("\"level\":\"WARN\"") && warned.contains(&name),
        "{warned}"
    );
}
