//! The nats-server `authorization` block, rendered from the fixed identities and the registry.
//!
//! nats-server reads JSON as its own config syntax, so the block is JSON: no quoting rules of
//! our own. There is no `no_auth_user`, so a connection without a known key is refused.

use std::path::Path;

use serde::Serialize;

use crate::AccessError;
use crate::perms::{Names, Permissions, Role, permissions};

#[derive(Serialize)]
struct User {
    nkey: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    permissions: Option<Permissions>,
}

/// The `authorization` block for `keys` (public key and role of each).
pub fn render(keys: &[(String, Role)], names: &Names) -> String {
    let users: Vec<User> = keys
        .iter()
        .map(|(key, role)| User {
            nkey: key.clone(),
            permissions: permissions(role, names),
        })
        .collect();
    let block = serde_json::json!({ "users": users });
    format!(
        "# Written by engram from the access registry; edits are overwritten.\nauthorization: {}\n",
        serde_json::to_string_pretty(&block).expect("json values serialize")
    )
}

/// The server's subject mapping that routes an agent's query about its own scope to the
/// memory node owning the scope's partition, for an events stream of `partitions`:
/// `engram.q.<tenant>.<agent>.<op>.<kind>.<id>` becomes
/// `engram.n.<partition>.<tenant>.<agent>.<op>.<kind>.<id>`, the partition computed by the
/// server with the same `partition()` function over the same tokens (tenant, scope kind,
/// scope id) as the stream's subject transform. Permissions are checked on the mapped
/// subject.
pub fn query_routing(partitions: u32) -> String {
    let (q, n) = (crate::perms::QUERY_PREFIX, crate::perms::NODE_PREFIX);
    let w = |tokens: std::ops::RangeInclusive<u32>| {
        tokens
            .map(|i| format!("{{{{wildcard({i})}}}}"))
            .collect::<Vec<_>>()
            .join(".")
    };
    format!(
        "# Written by engram: a query about a scope goes to the memory node that owns the\n\
         # scope's partition (partition() as in the events stream's transform). An agent's:\n\
         # engram.q.<tenant>.<agent>.<op>.<kind>.<id>; the admin's and the services':\n\
         # engram.q.<op>.<tenant>.<kind>.<id>.\n\
         mappings {{\n  \"{q}.*.*.*.*.*\": \"{n}.{{{{partition({partitions},1,4,5)}}}}.{agent}\"\n  \"{q}.*.*.*.*\": \"{n}.{{{{partition({partitions},2,3,4)}}}}.{privileged}\"\n}}\n",
        agent = w(1..=5),
        privileged = w(1..=4),
    )
}

/// Writes `text` to `path` atomically (a reader sees the old file or the new, never half),
/// mode 0600. Returns whether the content changed.
pub fn write_if_changed(path: &Path, text: &str) -> Result<bool, AccessError> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    crate::write_private(path, text)?;
    Ok(true)
}

/// How the server is told to read its config again; returns how long the reload took.
pub type Reload = Box<
    dyn Fn() -> futures::future::BoxFuture<'static, Result<std::time::Duration, String>>
        + Send
        + Sync,
>;

/// How far the server's authorization has caught up with the registry: every record up to
/// [`Enforced::seq`] (a key added, revoked or expired) is in force on the server. A key is
/// refused until its record is, so whoever hands one out can wait for it here rather than
/// retry against the server (each refused connection is an authorization violation in the
/// client's and the server's logs).
#[derive(Clone, Debug)]
pub struct Enforced(tokio::sync::watch::Receiver<u64>);

impl Enforced {
    /// The registry sequence in force on the server (0 before the first render).
    pub fn seq(&self) -> u64 {
        *self.0.borrow()
    }

    /// Waits until the record at `seq` is in force, at most `within`; false if it is not by
    /// then (or the enforcer stopped).
    pub async fn reached(&mut self, seq: u64, within: std::time::Duration) -> bool {
        matches!(
            tokio::time::timeout(within, self.0.wait_for(|s| *s >= seq)).await,
            Ok(Ok(_))
        )
    }
}

/// Keeps the server's `authorization` block (`path`) in step with the registry: after each
/// change it renders `fixed` (the admin and service keys) plus the registry's live agent
/// keys, writes the file if it changed, and reloads the server. A failed reload is retried
/// on the next change and every 5 s, so a revocation is never left unenforced silently.
/// Returns how far the server has caught up.
pub fn enforce(
    shared: crate::SharedRegistry,
    fixed: Vec<(String, Role)>,
    names: Names,
    path: std::path::PathBuf,
    reload: Reload,
    stop: tokio_util::sync::CancellationToken,
) -> Enforced {
    use engram_telemetry::metrics;
    let (enforced, watched) = tokio::sync::watch::channel(0);
    tokio::spawn(async move {
        let mut changes = shared.changes();
        let mut pending = false;
        loop {
            let (keys, applied) = {
                let state = shared.read().await;
                let mut keys = fixed.clone();
                keys.extend(state.live_keys());
                (keys, state.applied)
            };
            let seen = std::time::Instant::now();
            let text = render(&keys, &names);
            match write_if_changed(&path, &text) {
                Ok(changed) => pending |= changed,
                Err(e) => tracing::error!(error = %e, "cannot write the server's authorization"),
            }
            if pending {
                match reload().await {
                    Ok(took) => {
                        pending = false;
                        metrics::ACCESS_RELOADS.with_label_values(&["ok"]).inc();
                        metrics::ACCESS_ENFORCE_SECONDS.observe(seen.elapsed().as_secs_f64());
                        tracing::info!(
                            keys = keys.len(),
                            registry_seq = applied,
                            reload_ms = took.as_millis() as u64,
                            "server authorization reloaded"
                        );
                    }
                    Err(e) => {
                        metrics::ACCESS_RELOADS.with_label_values(&["error"]).inc();
                        tracing::error!(error = %e, "server authorization reload failed; retrying");
                    }
                }
            }
            if !pending {
                // Written and reloaded, or nothing to change: the server enforces `applied`.
                enforced.send_replace(applied);
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = changes.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(std::time::Duration::from_secs(5)), if pending => {}
            }
        }
    });
    Enforced(watched)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_is_unrestricted_and_others_are_allow_listed() {
        let text = render(
            &[
                ("UADMIN".into(), Role::Admin),
                ("UQUERY".into(), Role::Query),
                (
                    "UQRESP".into(),
                    Role::Responder(crate::perms::Service::Query),
                ),
            ],
            &Names::default(),
        );
        let json: serde_json::Value =
            serde_json::from_str(text.split_once("authorization: ").unwrap().1).unwrap();
        let users = json["users"].as_array().unwrap();
        assert_eq!(users[0]["nkey"], "UADMIN");
        assert!(users[0].get("permissions").is_none());
        assert!(users[1]["permissions"]["publish"]["allow"].is_array());
        // No identity replies through `allow_responses`: that would let a service answer at
        // whatever reply subject a caller names. The responder publishes to inboxes only.
        assert!(users[1]["permissions"].get("allow_responses").is_none());
        assert_eq!(
            users[2]["permissions"]["publish"]["allow"],
            serde_json::json!(["_INBOX.>"])
        );
    }
}

#[cfg(test)]
mod routing_tests {
    /// The shipped server config shows operators the block `engram up` writes: the same.
    #[test]
    fn the_deploy_config_shows_the_mapping_engram_writes() {
        let shipped = include_str!("../../../deploy/nats-server.conf");
        let written = super::query_routing(16);
        for line in written.lines().filter(|l| l.trim_start().starts_with('"')) {
            assert!(
                shipped.contains(line.trim()),
                "deploy/nats-server.conf lacks `{line}`"
            );
        }
    }

    #[test]
    fn the_query_mapping_hashes_tenant_kind_and_id_as_the_stream_does() {
        let text = super::query_routing(16);
        assert!(
            text.contains(r#""engram.q.*.*.*.*.*": "engram.n.{{partition(16,1,4,5)}}.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}.{{wildcard(4)}}.{{wildcard(5)}}""#),
            "{text}"
        );
        assert!(
            text.contains(r#""engram.q.*.*.*.*": "engram.n.{{partition(16,2,3,4)}}.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}.{{wildcard(4)}}""#),
            "{text}"
        );
    }
}
