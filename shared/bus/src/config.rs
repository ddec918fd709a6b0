use std::time::Duration;

use engram_schema::Limits;
use serde::{Deserialize, Serialize};

/// What the bus provisions and how it talks to the server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BusConfig {
    /// NATS URL, for example `nats://127.0.0.1:4222`. Not part of the `[bus]` config section:
    /// it is resolved from `[nats]` (or the managed server) by whoever builds the bus.
    #[serde(skip)]
    pub url: String,
    /// The identity to connect as (an nkey seed and the inbox prefix its permissions allow);
    /// `None` connects without one, which only a server run with `--insecure-no-auth` takes.
    /// Like the URL, resolved by whoever builds the bus (from a credentials file).
    #[serde(skip)]
    pub nkey: Option<NkeyAuth>,
    /// Shown in the server's connection list.
    pub client_name: String,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How often the client pings a server that has sent nothing; three unanswered pings
    /// close the connection and the client moves to another server. A server that hangs (or
    /// is cut off) keeps its sockets open, so this is how long a client stays with it:
    /// about three times this.
    #[serde(with = "humantime_serde")]
    pub ping_interval: Duration,
    /// How long an append waits for its ack before it fails as retryable.
    #[serde(with = "humantime_serde")]
    pub ack_timeout: Duration,
    /// Timeout of JetStream API requests (stream info, consumer creation).
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Publishes awaiting their ack at once, per connection; past it, publishers wait.
    pub max_inflight: usize,
    pub stream: StreamSettings,
    pub working_memory: WorkingMemorySettings,
    pub dead_letters: DeadLetterSettings,
    pub limits: Limits,
}

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            nkey: None,
            client_name: "engram".into(),
            connect_timeout: Duration::from_secs(5),
            ping_interval: Duration::from_secs(5),
            ack_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            max_inflight: 1024,
            stream: StreamSettings::default(),
            working_memory: WorkingMemorySettings::default(),
            dead_letters: DeadLetterSettings::default(),
            limits: Limits::default(),
        }
    }
}

/// Authentication with an nkey: the seed signs the server's nonce, the server holds only the
/// public key.
#[derive(Clone, PartialEq, Eq)]
pub struct NkeyAuth {
    pub seed: String,
    /// Where this identity's replies arrive (`_INBOX.a.<tenant>.<agent>` for an agent).
    pub inbox_prefix: String,
    /// For an agent's key, its tenant and name: its queries go to
    /// `engram.q.<tenant>.<agent>.<op>`, the only query subjects it may use.
    pub agent: Option<(engram_schema::Ident, engram_schema::Ident)>,
}

impl NkeyAuth {
    /// How a connection authenticates as `creds`.
    pub fn of(creds: &engram_access::Credentials) -> Self {
        Self {
            seed: creds.seed.clone(),
            inbox_prefix: creds.inbox_prefix(),
            agent: creds.agent_identity().map(|(t, a)| (t.clone(), a.clone())),
        }
    }
}

impl std::fmt::Debug for NkeyAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NkeyAuth")
            .field("seed", &"<redacted>")
            .field("inbox_prefix", &self.inbox_prefix)
            .finish()
    }
}

/// The events stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StreamSettings {
    pub name: String,
    /// 1 on a single node; 3 in a cluster for durability against a lost machine.
    pub replicas: usize,
    /// How long the server remembers event ids for dedup. A retry later than this is stored
    /// again, so it must exceed the longest retry horizon of any client.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
    /// Server-side cap on one message (payload plus headers), in bytes.
    pub max_msg_size: i32,
    /// Events older than this are dropped by the server; 0 keeps them forever.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
    /// Total size cap in bytes; -1 for none.
    pub max_bytes: i64,
    /// How many partitions the stream splits tenants' scopes into: each is read in order by
    /// one owner, and memory nodes own partitions. Fixed when the stream is created; a stream
    /// of another count is refused, as changing it re-hashes every scope (a migration).
    pub partitions: u32,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            name: "ENGRAM_EVENTS".into(),
            replicas: 1,
            duplicate_window: Duration::from_secs(10 * 60),
            max_msg_size: 1024 * 1024,
            max_age: Duration::ZERO,
            max_bytes: -1,
            partitions: engram_schema::DEFAULT_PARTITIONS,
        }
    }
}

/// The working-memory KV bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkingMemorySettings {
    pub bucket: String,
    /// TTL applied when a put names none.
    #[serde(with = "humantime_serde")]
    pub default_ttl: Duration,
    pub max_value_size: i32,
}

impl Default for WorkingMemorySettings {
    fn default() -> Self {
        Self {
            bucket: "engram_working".into(),
            default_ttl: Duration::from_secs(60 * 60),
            max_value_size: 256 * 1024,
        }
    }
}

/// The dead-letter stream (`ENGRAM_DLQ`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeadLetterSettings {
    /// Total size cap in bytes; the oldest dead letters go first. Anyone who can append can
    /// make poison events, and every projector dead-letters each one, so without a cap they
    /// could fill the disk.
    pub max_bytes: i64,
}

impl Default for DeadLetterSettings {
    fn default() -> Self {
        Self {
            max_bytes: 1024 * 1024 * 1024,
        }
    }
}

impl BusConfig {
    /// Checks what would otherwise fail later and less clearly at the server.
    pub fn validate(&self) -> Result<(), String> {
        // Headers (msg id, kind, traceparent) ride on top of the payload.
        const HEADER_ROOM: usize = 4096;
        if self.stream.max_msg_size <= 0 {
            return Err("stream.max_msg_size must be positive".into());
        }
        if self.limits.max_event_bytes + HEADER_ROOM > self.stream.max_msg_size as usize {
            return Err(format!(
                "limits.max_event_bytes ({}) plus {HEADER_ROOM} bytes of headers exceeds stream.max_msg_size ({}); lower the first or raise the second",
                self.limits.max_event_bytes, self.stream.max_msg_size
            ));
        }
        if self.ping_interval < Duration::from_millis(100) {
            return Err(format!(
                "bus.ping_interval is {:?}; at least 100ms",
                self.ping_interval
            ));
        }
        if self.stream.replicas == 0 || self.stream.replicas > 5 {
            return Err(format!(
                "stream.replicas is {}, expected 1 to 5",
                self.stream.replicas
            ));
        }
        if self.stream.partitions == 0 || self.stream.partitions > engram_schema::MAX_PARTITIONS {
            return Err(format!(
                "stream.partitions is {}, expected 1 to {} (the default is {})",
                self.stream.partitions,
                engram_schema::MAX_PARTITIONS,
                engram_schema::DEFAULT_PARTITIONS
            ));
        }
        if self.stream.duplicate_window.is_zero() {
            return Err(
                "stream.duplicate_window must be positive, or retried appends are stored twice"
                    .into(),
            );
        }
        if !self.stream.max_age.is_zero() && self.stream.duplicate_window > self.stream.max_age {
            return Err("stream.duplicate_window cannot exceed stream.max_age".into());
        }
        if self.dead_letters.max_bytes <= 0 {
            return Err(format!(
                "dead_letters.max_bytes is {}; it must be positive (the default is 1 GiB)",
                self.dead_letters.max_bytes
            ));
        }
        if self.max_inflight == 0 {
            return Err("max_inflight must be at least 1".into());
        }
        if self.working_memory.default_ttl < Duration::from_secs(1) {
            return Err(
                "working_memory.default_ttl must be at least 1s (the server's TTL granularity)"
                    .into(),
            );
        }
        let valid_name = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        };
        if !valid_name(&self.stream.name) || !valid_name(&self.working_memory.bucket) {
            return Err("stream.name and working_memory.bucket may use only [A-Za-z0-9_-]".into());
        }
        Ok(())
    }
}

/// The servers of `urls` (one NATS URL or several, comma-separated: a cluster's nodes, which
/// the client fails over between). Credentials in a URL stay in it for the connection's
/// options ([`url_credentials`]).
pub fn server_addrs(urls: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    let addrs = urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| {
            u.parse::<async_nats::ServerAddr>()
                .map_err(|e| format!("{} is not a nats url: {e}", redact_url(u)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if addrs.is_empty() {
        return Err("no nats url given".into());
    }
    Ok(addrs)
}

/// `urls` (one NATS URL or several, comma-separated) with any user info replaced by `***`:
/// `nats://user:pass@host:4222` becomes `nats://***@host:4222`, `token@host` becomes
/// `***@host`. Scheme, host and port stay, so the result still says where Engram connects.
///
/// Use it wherever a URL is shown, logged or served (banners, `/healthz`, errors): a URL given
/// with `--nats` may carry the credentials of the whole NATS account.
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(|url| {
            let (scheme, rest) = match url.find("://") {
                Some(at) => url.split_at(at + 3),
                None => ("", url),
            };
            // The last `@`: a password may hold an unescaped `@`, and hiding a little too much
            // is the safe way to be wrong.
            match rest.rfind('@') {
                Some(at) => format!("{scheme}***{}", &rest[at..]),
                None => url.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// What a NATS URL's user info says: `user:pass@host` or `token@host`.
#[derive(Clone, PartialEq, Eq)]
pub enum UrlCredentials {
    UserPassword { user: String, password: String },
    Token(String),
}

impl std::fmt::Debug for UrlCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Secrets never reach a log line, even through `{:?}`.
        match self {
            UrlCredentials::UserPassword { user, .. } => {
                write!(f, "UserPassword {{ user: {user:?}, password: *** }}")
            }
            UrlCredentials::Token(_) => write!(f, "Token(***)"),
        }
    }
}

/// The credentials in `urls` (comma-separated), from the first URL that carries any,
/// percent-decoded. async-nats reads only the host and port of a URL, so without this a
/// `--nats nats://user:pass@host:4222` would connect anonymously and be refused.
pub fn url_credentials(urls: &str) -> Option<UrlCredentials> {
    urls.split(',').find_map(|url| {
        let rest = url.find("://").map_or(url, |at| &url[at + 3..]);
        let userinfo = &rest[..rest.rfind('@')?];
        Some(match userinfo.split_once(':') {
            Some((user, password)) => UrlCredentials::UserPassword {
                user: percent_decode(user.trim()),
                password: percent_decode(password),
            },
            None => UrlCredentials::Token(percent_decode(userinfo.trim())),
        })
    })
}

/// Connect options carrying the credentials of `urls`, if it has any: for callers that open
/// their own connection rather than a [`crate::Bus`].
pub fn connect_options(urls: &str) -> async_nats::ConnectOptions {
    match url_credentials(urls) {
        Some(UrlCredentials::UserPassword { user, password }) => {
            async_nats::ConnectOptions::with_user_and_password(user, password)
        }
        Some(UrlCredentials::Token(token)) => async_nats::ConnectOptions::with_token(token),
        None => async_nats::ConnectOptions::new(),
    }
}

/// `%XX` escapes decoded; anything that is not a valid escape is kept as it is.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::{UrlCredentials, redact_url, server_addrs, url_credentials};

    #[test]
    fn several_urls_are_several_servers_and_a_bad_one_is_named() {
        let addrs = server_addrs("nats://127.0.0.1:4222, nats://127.0.0.1:4223,").unwrap();
        assert_eq!(addrs.len(), 2);
        assert_eq!(addrs[1].port(), 4223);
        let error = server_addrs("nats://127.0.0.1:4222,nats://u:secret@[::1").unwrap_err();
        assert!(error.contains("is not a nats url"), "{error}");
        assert!(!error.contains("secret"), "{error}");
        assert!(server_addrs(" , ").is_err());
    }

    #[test]
    fn reads_credentials_from_the_first_url_that_has_them() {
        assert_eq!(url_credentials("nats://127.0.0.1:4222"), None);
        assert_eq!(
            url_credentials("nats://h1:4222,nats://engram:p%40ss:w@h2:4222"),
            Some(UrlCredentials::UserPassword {
                user: "engram".into(),
                password: "p@ss:w".into()
            })
        );
        assert_eq!(
            url_credentials("s3cret@127.0.0.1:4222"),
            Some(UrlCredentials::Token("s3cret".into()))
        );
        let shown = format!("{:?}", url_credentials("nats://u:hidden@h").unwrap());
        assert!(!shown.contains("hidden"), "{shown}");
    }

    #[test]
    fn redacts_user_info_and_keeps_where_it_connects() {
        for (url, shown) in [
            ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
            ("nats://user:pass@host:4222", "nats://***@host:4222"),
            ("nats://s3cret-token@host:4222", "nats://***@host:4222"),
            ("token@host:4222", "***@host:4222"),
            (
                "tls://u:p@ss@nats.example.com",
                "tls://***@nats.example.com",
            ),
            ("host:4222", "host:4222"),
            ("", ""),
            (
                "nats://a:b@h1:4222, nats://h2:4222,nats://tok@h3:4222",
                "nats://***@h1:4222, nats://h2:4222,nats://***@h3:4222",
            ),
            ("ws://user:pass@[::1]:8080/path", "ws://***@[::1]:8080/path"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
            assert!(!redact_url(url).contains("pass"));
        }
    }
}
