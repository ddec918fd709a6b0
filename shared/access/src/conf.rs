//! The nats-server `authorization` block, rendered from the fixed identities and the registry.
//!
//! nats-server reads JSON as its own config syntax, so the block is JSON: no quoting rules of
//! our own. There is no `no_auth_user`, so a connection without a known key is refused.

use std::path::Path;

use serde::Serialize;

use crate::AccessError;
use crate::perms::{Names, Permissions, Role, permissions};
use crate::registry::Registry;

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

/// The keys the server admits: `fixed` (the admin and service keys) first, then every live
/// agent key of `registry`. What [`enforce`] renders, and what `engram access render` prints
/// for a server Engram does not run: one list, so both write the same block.
pub fn keys_in_force(fixed: &[(String, Role)], registry: &Registry) -> Vec<(String, Role)> {
    let mut keys = fixed.to_vec();
    keys.extend(registry.live_keys());
    keys
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
/// keys, writes the file if it changed, and reloads the server. A failed write or reload is
/// retried on the next change and every 5 s, so a revocation is never left unenforced
/// silently. A key that expires ([`crate::Record::AgentKeyAdded`]'s `expires_at`) needs no
/// record to go: the block is rendered again when the next expiry passes, so the key of a
/// run killed before it could revoke it stops working by itself.
/// Returns how far the server has caught up.
pub fn enforce(
    shared: crate::SharedRegistry,
    fixed: Vec<(String, Role)>,
    names: Names,
    path: std::path::PathBuf,
    reload: Reload,
    stop: tokio_util::sync::CancellationToken,
) -> Enforced {
    keep_in_step(shared, fixed, names, path, Some(reload), false, stop)
}

/// [`enforce`], for whoever writes the block of a server it does not run
/// (`engram access render --follow`): `reload` may be `None` (the server is told some
/// other way), and with `reload_at_start` it runs once at start even when the file already
/// holds the block, because an earlier writer may have stopped between writing the file and
/// reloading the server, which would leave a revoked key admitted until the next change.
pub fn keep_in_step(
    shared: crate::SharedRegistry,
    fixed: Vec<(String, Role)>,
    names: Names,
    path: std::path::PathBuf,
    reload: Option<Reload>,
    reload_at_start: bool,
    stop: tokio_util::sync::CancellationToken,
) -> Enforced {
    use engram_telemetry::metrics;
    let (enforced, watched) = tokio::sync::watch::channel(0);
    tokio::spawn(async move {
        let mut changes = shared.changes();
        let mut pending = reload_at_start && reload.is_some();
        loop {
            // Only ever a fold of records read without error: a lost connection leaves the
            // registry as it was, so the block never shrinks to the fixed keys by accident.
            let (keys, applied, next_expiry) = {
                let state = shared.read().await;
                let next_expiry = state.next_expiry(chrono::Utc::now());
                (keys_in_force(&fixed, &state), state.applied, next_expiry)
            };
            let seen = std::time::Instant::now();
            let text = render(&keys, &names);
            // A failed write is tried again like a failed reload: the file may still admit a
            // revoked key.
            let (written, unwritten) = match write_if_changed(&path, &text) {
                Ok(changed) => (changed, false),
                Err(e) => {
                    tracing::error!(error = %e, "cannot write the server's authorization; retrying");
                    (false, true)
                }
            };
            pending |= written;
            match &reload {
                Some(reload) if pending => match reload().await {
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
                },
                Some(_) => {}
                None => {
                    pending = false;
                    if written {
                        tracing::info!(
                            keys = keys.len(),
                            registry_seq = applied,
                            path = %path.display(),
                            "server authorization written"
                        );
                    }
                }
            }
            if !pending && !unwritten {
                // Written and reloaded, or nothing to change: the server enforces `applied`.
                enforced.send_replace(applied);
            }
            let until_expiry = next_expiry.map(until);
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = changes.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(std::time::Duration::from_secs(5)), if pending || unwritten => {}
                _ = tokio::time::sleep(until_expiry.unwrap_or_default()), if until_expiry.is_some() => {
                    // Woken at most a minute ahead of it (`until`): count only expiries.
                    if next_expiry.is_some_and(|at| at <= chrono::Utc::now()) {
                        metrics::ACCESS_EXPIRY_RENDERS.inc();
                        tracing::info!(expired_at = ?next_expiry, "a key expired; rendering the server's authorization again");
                    }
                }
            }
        }
    });
    Enforced(watched)
}

/// How long to sleep until a key's expiry `at` has passed: a little past it, so that the
/// render it wakes finds the key expired, and at most a minute, so that a wall clock set
/// back or forward is caught up with (a render that changes nothing writes nothing).
fn until(at: chrono::DateTime<chrono::Utc>) -> std::time::Duration {
    const PAST_IT: std::time::Duration = std::time::Duration::from_millis(20);
    let left = (at - chrono::Utc::now()).to_std().unwrap_or_default();
    (left + PAST_IT).min(std::time::Duration::from_secs(60))
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
