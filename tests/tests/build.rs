//! The README's first command is the build everything else reuses.
//!
//! A feature that a test or bench crate turns on is unified, by cargo's resolver, into every
//! crate of the same build. When `engram-bench` enabled `engram-vector/bench` and the tests
//! took `engram-embed/test-util` as a normal dependency, `cargo build --release --workspace`
//! built those crates with features that `cargo run --release -p engram` does not ask for, so
//! the README's command compiled for minutes after a workspace build, and the `engram` binary
//! that `cargo test --workspace` builds for the Python tests carried test-only code.
//!
//! These tests ask cargo itself (`cargo tree`, which resolves features as the build does) for
//! the features of every package `engram` links, alone and in the whole workspace's build.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

/// Package (`name vX.Y.Z`, with a path for workspace members) to the feature sets it is built
/// with. A package can be built twice (for the host, as a build or proc-macro dependency, and
/// for the target), hence a set.
type Features = BTreeMap<String, BTreeSet<String>>;

fn workspace_manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the workspace")
        .join("Cargo.toml")
}

/// `cargo tree` with `edges` (the kinds of dependencies the build would follow) and `select`
/// (which packages are built).
fn features(edges: &str, select: &[&str]) -> Features {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .arg("tree")
        .arg("--locked")
        .arg("--manifest-path")
        .arg(workspace_manifest())
        .args(["--edges", edges, "--prefix", "none", "--format", "{p}|{f}"])
        .args(select)
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut features = Features::new();
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let line = line.trim_end_matches(" (*)");
        let Some((package, set)) = line.split_once('|') else {
            continue;
        };
        features
            .entry(package.trim().to_owned())
            .or_default()
            .insert(set.trim().to_owned());
    }
    assert!(
        features.keys().any(|p| p.starts_with("engram v")),
        "cargo tree listed no engram package: {features:?}"
    );
    features
}

/// Every unit the README's build of `engram` needs, as (package, features), that `build` does
/// not also build: each is a crate the README's command would compile again.
fn rebuilt(engram: &Features, build: &Features) -> Vec<(String, String)> {
    let mut missing = Vec::new();
    for (package, sets) in engram {
        for set in sets {
            if !build.get(package).is_some_and(|s| s.contains(set)) {
                missing.push((package.clone(), set.clone()));
            }
        }
    }
    missing
}

fn engram_alone() -> Features {
    features("normal,build", &["--package", "engram"])
}

#[test]
fn a_release_workspace_build_leaves_nothing_for_the_readme_command_to_compile() {
    let engram = engram_alone();
    let workspace = features("normal,build", &["--workspace"]);
    let rebuilt = rebuilt(&engram, &workspace);
    assert!(
        rebuilt.is_empty(),
        "`cargo build --workspace` builds these crates with other features than \
         `cargo run -p engram` does, so the README's command compiles them again; a test or \
         bench crate turns the feature on (move the code into engram-fixtures or a dev-dependency): \
         {rebuilt:#?}"
    );
}

#[test]
fn the_engram_binary_the_tests_build_carries_none_of_our_test_code() {
    let engram = engram_alone();
    // `cargo test --workspace` also follows every member's dev-dependencies.
    let tests = features("normal,build,dev", &["--workspace"]);
    let rebuilt = rebuilt(&engram, &tests);
    // Our own crates must be built exactly as for production: a test-only feature of one of
    // them would put test code into target/debug/engram, which the Python tests run.
    let ours: Vec<_> = rebuilt
        .iter()
        .filter(|(package, _)| package.contains("(/") || package.contains("(\\"))
        .collect();
    assert!(
        ours.is_empty(),
        "dev-dependencies change features of Engram's own crates in the test build: {ours:#?}"
    );
    // Third-party crates whose dev-only features are known and carry no test code:
    // - `syn` (`fold`) and `time` (`macros`) come from the browser test's WebDriver client;
    //   both are compile-time only (a proc-macro's parser, and `time`'s macro re-exports).
    // - `rmcp` (its client and transports) and `reqwest` (`stream`, which rmcp's client uses):
    //   the MCP tests speak to `engram mcp` through the official client.
    // Any other crate on this list is a new leak.
    let known = ["syn v", "time v", "rmcp v", "reqwest v"];
    let unknown: Vec<_> = rebuilt
        .iter()
        .filter(|(package, _)| !known.iter().any(|k| package.starts_with(k)))
        .collect();
    assert!(
        unknown.is_empty(),
        "dev-dependencies change features of crates the engram binary links: {unknown:#?}"
    );
}
