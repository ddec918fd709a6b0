//! The configuration's layers against the real process environment: defaults, then TOML, then
//! `ENGRAM_*` env, then flags, and the errors a typo or a bad value gets.
//!
//! One test in a binary of its own, because it sets process environment variables: nothing else
//! in this process reads them meanwhile. (figment's `Jail` would do the same inside the unit
//! tests, but its `test` feature would then be unified into the `engram` binary that
//! `cargo test --workspace` builds for the Python tests.)

use std::path::{Path, PathBuf};
use std::time::Duration;

use engram::config::{Config, ConfigError, FlagOverrides};

fn set(key: &str, value: &str) {
    // SAFETY: this binary runs one test, on one thread, and nothing else reads the environment
    // while it runs.
    unsafe { std::env::set_var(key, value) }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn load_err(path: &Path) -> String {
    Config::load(Some(path), &FlagOverrides::default())
        .unwrap_err()
        .to_string()
}

#[test]
fn layers_apply_in_order_and_bad_values_are_reported() {
    for (key, _) in std::env::vars() {
        if key.starts_with("ENGRAM_") {
            // SAFETY: as in `set`.
            unsafe { std::env::remove_var(key) }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let toml = write(
        dir.path(),
        "engram.toml",
        r#"
        home = "/from/toml"
        [nats]
        managed_port = 5000
        [bus]
        ack_timeout = "9s"
        [bus.stream]
        replicas = 3
        duplicate_window = "20m"
        [http]
        listen = "127.0.0.1:9000"
        "#,
    );
    set("ENGRAM_BUS__STREAM__REPLICAS", "2");
    set("ENGRAM_NATS__MANAGED_PORT", "5001");
    set("ENGRAM_NATS_SERVER", "/ignored/by/config");
    set("ENGRAM_CACHE_DIR", "/ignored/too");
    set("ENGRAM_HTTP__LISTEN", "127.0.0.1:9001");
    set("ENGRAM_HTTP__HEADER_READ_TIMEOUT", "3s");
    set("ENGRAM_HTTP__MAX_CONNECTIONS", "64");
    let flags = FlagOverrides {
        http_listen: Some("127.0.0.1:9002".parse().unwrap()),
        ..FlagOverrides::default()
    };
    let c = Config::load(Some(&toml), &flags).unwrap();
    set("ENGRAM_HOME", "/from/env");
    let moved = Config::load(Some(&toml), &flags).unwrap();
    assert_eq!(moved.home, PathBuf::from("/from/env"));
    assert_eq!(c.home, PathBuf::from("/from/toml")); // toml over default
    assert_eq!(c.bus.ack_timeout, Duration::from_secs(9));
    assert_eq!(c.bus.stream.duplicate_window, Duration::from_secs(1200));
    assert_eq!(c.bus.stream.replicas, 2); // env over toml
    assert_eq!(c.nats.managed_port, 5001); // env over toml
    assert_eq!(c.http.listen.port(), 9002); // flag over env over toml
    let limits = c.serve_limits();
    assert_eq!(limits.header_read_timeout, Duration::from_secs(3));
    assert_eq!(limits.max_connections, 64);
    assert_eq!(
        limits.body_read_timeout,
        engram_gateway::ServeLimits::default().body_read_timeout
    );
    assert_eq!(c.client_url(), "nats://127.0.0.1:5001");
    // The dump parses back to the same config.
    let again: Config = toml::from_str(&c.to_toml()).unwrap();
    assert_eq!(again, c);

    // Typos and invalid values name the key at fault.
    for key in [
        "ENGRAM_HOME",
        "ENGRAM_BUS__STREAM__REPLICAS",
        "ENGRAM_NATS__MANAGED_PORT",
        "ENGRAM_HTTP__LISTEN",
        "ENGRAM_HTTP__HEADER_READ_TIMEOUT",
        "ENGRAM_HTTP__MAX_CONNECTIONS",
    ] {
        // SAFETY: as in `set`.
        unsafe { std::env::remove_var(key) }
    }
    let cases = [
        ("typo.toml", "[bus.stream]\nreplica = 3\n", "replica"),
        (
            "bad.toml",
            "[bus.stream]\nduplicate_window = \"0s\"\n",
            "duplicate_window",
        ),
        (
            "slow.toml",
            "[http]\nbody_read_timeout = \"0s\"\n",
            "http.body_read_timeout",
        ),
        (
            "few.toml",
            "[http]\nmax_connections = 0\n",
            "http.max_connections",
        ),
        (
            "nice.toml",
            "[projectors]\napply_nice = 20\n",
            "projectors.apply_nice",
        ),
        (
            "threads.toml",
            "[projectors]\napply_threads = 100000\n",
            "projectors.apply_threads",
        ),
    ];
    for (name, text, named) in cases {
        let err = load_err(&write(dir.path(), name, text));
        assert!(err.contains(named), "{name}: {err}");
    }
    let missing = Config::load(
        Some(&dir.path().join("nope.toml")),
        &FlagOverrides::default(),
    );
    assert!(matches!(missing, Err(ConfigError::MissingFile(_))));
}
