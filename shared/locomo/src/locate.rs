//! Where the development split lives: the project keeps its shared material, benchmark data
//! included, in a `shared/` folder beside the repository (`../shared/bench/locomo-dev.json`
//! from the repository root).

use std::path::{Path, PathBuf};

/// The environment variable that names the dev split's file, overriding the search.
pub const DEV_SPLIT_ENV: &str = "ENGRAM_LOCOMO_DEV";

const BESIDE_ROOT: &str = "../shared/bench/locomo-dev.json";

/// Finds `locomo-dev.json`: `$ENGRAM_LOCOMO_DEV` if set; else beside this repository's root;
/// else, for a clone of a local checkout, beside that checkout's root. The error lists every
/// place looked at and says how to provide the file.
pub fn dev_split() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(DEV_SPLIT_ENV) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "{DEV_SPLIT_ENV} is {}, which is not a file; point it at locomo-dev.json",
                path.display()
            ))
        };
    }
    // This crate is <root>/shared/locomo.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut tried = vec![root.join(BESIDE_ROOT)];
    if let Some(origin) = local_origin(&root) {
        tried.push(origin.join(BESIDE_ROOT));
    }
    if let Some(found) = tried.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    Err(format!(
        "the LoCoMo dev split (locomo-dev.json) is not at {}; put the project's shared/ folder (it holds bench/locomo-dev.json) beside the repository, or set {DEV_SPLIT_ENV} to the file",
        tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    ))
}

/// The checkout a clone was made from, when that is a folder on this machine.
fn local_origin(root: &Path) -> Option<PathBuf> {
    let output = std::process::Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["remote", "get-url", "origin"])
        .output()
        .ok()?;
    let url = String::from_utf8(output.stdout).ok()?;
    let url = url.trim();
    let path = Path::new(url.strip_prefix("file://").unwrap_or(url));
    (output.status.success() && path.is_absolute() && path.is_dir()).then(|| path.to_owned())
}
