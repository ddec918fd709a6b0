//! `engram demo continuity` as a user runs it: it starts its own hub and leaf (two homes,
//! two `engram up`), runs instance A in the cloud under `engram run` while the laptop is
//! offline, and resumes on the laptop; it checks every answer of the brief against the ids
//! instance A recorded and fails naming the one that differs. Here: it succeeds, and what it
//! reports is what instance A wrote.

use std::process::Command;

#[test]
fn the_continuity_demo_resumes_on_the_laptop_what_the_cloud_decided_failed_fixed_and_left_open() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_engram"))
        .args(["--json", "demo", "continuity", "--dir"])
        .arg(dir.path())
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_CREDS")
        .env_remove("ENGRAM_API_KEY")
        .env_remove("ENGRAM_HOME")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the demo failed: {stderr}");
    let outcome: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    // The ids instance A recorded as it appended (its own file), and what the demo reports.
    let ids = std::fs::read_to_string(dir.path().join("work").join("ids")).unwrap();
    for key in ["decision", "failure", "fix", "skill"] {
        let written = ids
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap();
        assert_eq!(outcome[key], written, "{outcome}");
    }
    assert_eq!(
        outcome["open"],
        serde_json::json!(["add a regression test for the logout race"]),
        "{outcome}"
    );
    // Instance A's notes, stored in the cloud's Object Store, were fetched on the laptop.
    assert_eq!(outcome["artifacts_on_leaf"], 1, "{outcome}");
    let notes = std::fs::read_to_string(dir.path().join("work/resume/artifacts/notes.md")).unwrap();
    assert_eq!(
        notes,
        std::fs::read_to_string(dir.path().join("work/notes.md")).unwrap()
    );
    // The brief on the laptop cites them.
    let brief = std::fs::read_to_string(dir.path().join("work/resume/brief.md")).unwrap();
    for key in ["decision", "failure", "fix"] {
        let id = outcome[key].as_str().unwrap();
        assert!(
            brief.contains(id),
            "the brief does not cite the {key} {id}:\n{brief}"
        );
    }
}
