//! Given/when/then tests of the skill registry's semantics.

mod common;

use common::*;
use engram_schema::EventKind;
use engram_skills::{Applied, MAX_NAME_CHARS, SkillRegistry};
use serde_json::{Value, json};

#[test]
fn a_recorded_skill_can_be_read_back() {
    let team = scope("acme", "team-a");
    let mut given = Stream::default();

    let applied = given.apply(&recorded(
        &team,
        json!({
            "name": " deploy-service ",
            "description": "Deploy the web service",
            "steps": ["build", "push", "roll out"],
            "script": "make deploy",
            "preconditions": ["tests pass"],
            "unknown": "ignored",
        }),
        "2024-01-01",
    ));

    assert_eq!(
        applied,
        Ok(Applied::Recorded {
            version: 1,
            latest: true
        })
    );
    let skill = given.model.get(&team, "deploy-service").expect("recorded");
    assert_eq!(skill.name, "deploy-service");
    assert_eq!(skill.version, 1);
    assert_eq!(skill.description, "Deploy the web service");
    assert_eq!(skill.steps, ["build", "push", "roll out"]);
    assert_eq!(skill.script.as_deref(), Some("make deploy"));
    assert_eq!(skill.preconditions, ["tests pass"]);
    assert_eq!(
        (skill.successes, skill.failures, skill.last_used),
        (0, 0, None)
    );
    assert_eq!(skill.recorded_at, t("2024-01-01"));
    assert_eq!(skill.source.seq, 1);
    assert_eq!(skill.scope, team);
    assert_eq!(skill.success_rate(), 0.5);
    assert_eq!(given.model.len(), 1);
    assert!(
        given.model.get(&team, "Deploy-Service").is_none(),
        "case matters"
    );
}

#[test]
fn versions_default_to_one_above_the_highest() {
    let team = scope("acme", "team-a");
    let mut given = Stream::default();

    let versions: Vec<_> = (0..3)
        .map(|_| given.apply(&skill(&team, "lint", "Run the linter", "2024-01-01")))
        .collect();

    assert_eq!(
        versions,
        [1, 2, 3].map(|version| Ok(Applied::Recorded {
            version,
            latest: true
        }))
    );
    assert_eq!(given.model.get(&team, "lint").map(|s| s.version), Some(3));
    assert_eq!(given.model.len(), 1, "one skill, three versions");
}

#[test]
fn a_lower_or_equal_version_is_history_and_does_not_replace_the_latest() {
    let team = scope("acme", "team-a");
    let version = |v: u32, description: &str| {
        recorded(
            &team,
            json!({"name": "lint", "version": v, "description": description}),
            "2024-01-01",
        )
    };
    let mut given = Stream::given(&[version(1, "first"), version(3, "third")]);

    let lower = given.apply(&version(2, "second"));
    let equal = given.apply(&version(3, "third again"));
    let next = given.apply(&skill(&team, "lint", "fourth", "2024-01-01"));

    assert_eq!(
        lower,
        Ok(Applied::Recorded {
            version: 2,
            latest: false
        })
    );
    assert_eq!(
        equal,
        Ok(Applied::Recorded {
            version: 3,
            latest: false
        })
    );
    assert_eq!(
        next,
        Ok(Applied::Recorded {
            version: 4,
            latest: true
        })
    );
    let history: Vec<_> = given
        .model
        .versions(&team, "lint")
        .iter()
        .map(|s| (s.version, s.description.as_str()))
        .collect();
    assert_eq!(
        history,
        [
            (1, "first"),
            (2, "second"),
            (3, "third"),
            (3, "third again"),
            (4, "fourth")
        ]
    );
    assert_eq!(
        given.model.get(&team, "lint").unwrap().description,
        "fourth"
    );
}

#[test]
fn of_two_records_of_one_version_the_first_stays_latest_and_gets_the_counts() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[
        recorded(
            &team,
            json!({"name": "lint", "version": 2, "description": "first"}),
            "2024-01-01",
        ),
        recorded(
            &team,
            json!({"name": "lint", "version": 2, "description": "second"}),
            "2024-01-02",
        ),
    ]);

    let counted = given.apply(&used(&team, "lint", true, "2024-01-03"));

    assert_eq!(counted, Ok(Applied::OutcomeCounted { version: 2 }));
    let versions = given.model.versions(&team, "lint");
    assert_eq!(
        (versions[0].description.as_str(), versions[0].successes),
        ("first", 1)
    );
    assert_eq!(
        (versions[1].description.as_str(), versions[1].successes),
        ("second", 0)
    );
    assert_eq!(given.model.get(&team, "lint").unwrap().description, "first");
}

#[test]
fn a_skill_recorded_with_observed_outcomes_starts_with_those_counts() {
    let team = scope("acme", "team-a");
    // Given a skill recorded with the outcomes of the episodes it was promoted from...
    let mut given = Stream::given(&[recorded(
        &team,
        json!({
            "name": "promoted-open-file",
            "description": "open file #, then edit file #",
            "observed": {"successes": 3, "failures": 1},
        }),
        "2024-01-01",
    )]);
    let skill = given.model.get(&team, "promoted-open-file").unwrap();
    // ...then it is not untried: its counts and success rate are the observed ones, and
    // they carry no time of use.
    assert_eq!(
        (skill.successes, skill.failures, skill.last_used),
        (3, 1, None)
    );
    assert!((skill.success_rate() - 4.0 / 6.0).abs() < 1e-12);

    // When it is used again, the reported outcome adds to them.
    given
        .apply(&used(&team, "promoted-open-file", true, "2024-01-02"))
        .unwrap();
    let skill = given.model.get(&team, "promoted-open-file").unwrap();
    assert_eq!(
        (skill.successes, skill.failures, skill.last_used),
        (4, 1, Some(t("2024-01-02")))
    );

    // A record repeating that version number is history and brings no counts, observed
    // or not; a new version starts with its own observed counts, not the old version's.
    given
        .apply(&recorded(
            &team,
            json!({"name": "promoted-open-file", "version": 1, "description": "again",
                   "observed": {"successes": 9, "failures": 0}}),
            "2024-01-03",
        ))
        .unwrap();
    given
        .apply(&recorded(
            &team,
            json!({"name": "promoted-open-file", "description": "more evidence",
                   "observed": {"successes": 5, "failures": 1}}),
            "2024-01-04",
        ))
        .unwrap();
    let counts: Vec<_> = given
        .model
        .versions(&team, "promoted-open-file")
        .iter()
        .map(|s| (s.version, s.successes, s.failures))
        .collect();
    assert_eq!(counts, [(1, 4, 1), (1, 0, 0), (2, 5, 1)]);
}

#[test]
fn outcomes_count_for_the_latest_or_the_named_version() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[
        skill(&team, "lint", "Run the linter", "2024-01-01"),
        skill(&team, "lint", "Run the linter faster", "2024-02-01"),
    ]);

    let results = [
        given.apply(&used(&team, "lint", true, "2024-03-05")),
        given.apply(&used(&team, "lint", false, "2024-03-01")),
        given.apply(&outcome(
            &team,
            json!({"skill": "lint", "success": false, "version": 1}),
            "2024-03-02",
        )),
    ];

    assert_eq!(
        results,
        [
            Ok(Applied::OutcomeCounted { version: 2 }),
            Ok(Applied::OutcomeCounted { version: 2 }),
            Ok(Applied::OutcomeCounted { version: 1 }),
        ]
    );
    let versions = given.model.versions(&team, "lint");
    assert_eq!((versions[0].successes, versions[0].failures), (0, 1));
    assert_eq!((versions[1].successes, versions[1].failures), (1, 1));
    assert_eq!(
        versions[1].last_used,
        Some(t("2024-03-05")),
        "the latest, not the last applied"
    );
    assert_eq!(versions[0].last_used, Some(t("2024-03-02")));
    assert_eq!(versions[1].success_rate(), 0.5);
}

#[test]
fn outcomes_before_their_skill_wait_and_then_count() {
    let team = scope("acme", "team-a");
    let mut given = Stream::default();
    let early = [
        given.apply(&used(&team, "lint", true, "2024-01-01")),
        given.apply(&used(&team, "lint", true, "2024-01-03")),
        given.apply(&outcome(
            &team,
            json!({"skill": "lint", "success": false, "version": 2}),
            "2024-01-02",
        )),
    ];
    assert_eq!(
        early,
        [
            Ok(Applied::OutcomePending { version: None }),
            Ok(Applied::OutcomePending { version: None }),
            Ok(Applied::OutcomePending { version: Some(2) }),
        ]
    );
    assert!(given.model.get(&team, "lint").is_none());
    assert!(given.model.is_empty(), "pending outcomes are not skills");
    let pending = given.model.pending(&team, "lint").expect("pending");
    assert_eq!(pending.unversioned.successes, 2);
    assert_eq!(pending.by_version[&2].failures, 1);

    given
        .apply(&skill(&team, "lint", "Run the linter", "2024-01-04"))
        .unwrap();

    let first = given.model.get(&team, "lint").unwrap();
    assert_eq!((first.version, first.successes, first.failures), (1, 2, 0));
    assert_eq!(first.last_used, Some(t("2024-01-03")));
    let pending = given
        .model
        .pending(&team, "lint")
        .expect("version 2 still waits");
    assert!(pending.unversioned.is_empty());

    given
        .apply(&skill(&team, "lint", "Run the linter faster", "2024-01-05"))
        .unwrap();

    let second = given.model.get(&team, "lint").unwrap();
    assert_eq!(
        (second.version, second.successes, second.failures),
        (2, 0, 1)
    );
    assert_eq!(second.last_used, Some(t("2024-01-02")));
    assert!(given.model.pending(&team, "lint").is_none());
}

#[test]
fn an_outcome_naming_an_unrecorded_version_of_a_known_skill_waits_for_it() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[skill(&team, "lint", "Run the linter", "2024-01-01")]);

    let applied = given.apply(&outcome(
        &team,
        json!({"skill": "lint", "success": true, "version": 3}),
        "2024-01-02",
    ));
    given
        .apply(&recorded(
            &team,
            json!({"name": "lint", "version": 3, "description": "v3"}),
            "2024-01-03",
        ))
        .unwrap();

    assert_eq!(applied, Ok(Applied::OutcomePending { version: Some(3) }));
    let versions = given.model.versions(&team, "lint");
    assert_eq!((versions[0].successes, versions[1].successes), (0, 1));
}

#[test]
fn outcomes_in_either_order_end_with_the_same_counts() {
    let team = scope("acme", "team-a");
    let record = skill(&team, "lint", "Run the linter", "2024-01-01");
    let outcomes = [
        used(&team, "lint", true, "2024-01-02"),
        outcome(
            &team,
            json!({"skill": "lint", "success": false, "version": 1}),
            "2024-01-03",
        ),
    ];
    let skill_first = Stream::given(&[record.clone(), outcomes[0].clone(), outcomes[1].clone()]);
    let skill_last = Stream::given(&[outcomes[0].clone(), outcomes[1].clone(), record]);

    let counts = |stream: &Stream| {
        let skill = stream.model.get(&team, "lint").unwrap();
        (skill.successes, skill.failures, skill.last_used)
    };
    assert_eq!(counts(&skill_first), (1, 1, Some(t("2024-01-03"))));
    assert_eq!(counts(&skill_last), counts(&skill_first));
}

#[test]
fn outcomes_naming_no_skill_are_ignored() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[skill(&team, "lint", "Run the linter", "2024-01-01")]);
    let before = given.model.versions(&team, "lint")[0].clone();

    let results = [
        given.apply(&outcome(&team, json!({"success": true}), "2024-01-02")),
        given.apply(&outcome(
            &team,
            json!({"skill": null, "success": true}),
            "2024-01-02",
        )),
        given.apply(&event(&team, EventKind::Outcome, None, "2024-01-02")),
        given.apply(&event(
            &team,
            EventKind::Outcome,
            Some(json!("done")),
            "2024-01-02",
        )),
        given.apply(&event(
            &team,
            EventKind::Observation,
            Some(json!({"skill": "lint", "success": true})),
            "2024-01-02",
        )),
    ];

    assert!(
        results.iter().all(|r| *r == Ok(Applied::Ignored)),
        "{results:?}"
    );
    assert_eq!(given.model.versions(&team, "lint"), [&before]);
    assert!(given.model.pending(&team, "lint").is_none());
    assert_eq!(given.model.applied_seq(), Some(6));
}

#[test]
fn search_ranks_by_relevance() {
    let team = scope("acme", "team-a");
    let given = Stream::given(&[
        skill(
            &team,
            "deploy-web-service",
            "Deploy the web service to the kubernetes cluster",
            "2024-01-01",
        ),
        skill(
            &team,
            "rotate-credentials",
            "Rotate database credentials in vault",
            "2024-01-01",
        ),
        skill(
            &team,
            "deploy-docs",
            "Deploy the documentation site",
            "2024-01-01",
        ),
        recorded(
            &team,
            json!({"name": "restart", "description": "Restart a process", "steps": ["kubectl rollout restart"], "preconditions": ["access to the kubernetes cluster"]}),
            "2024-01-01",
        ),
    ]);

    let found = given.model.search(
        std::slice::from_ref(&team),
        "Deploy the web service to Kubernetes",
        10,
    );

    let mut names: Vec<_> = found.iter().map(|(s, _)| s.name.as_str()).collect();
    assert_eq!(names[0], "deploy-web-service", "{found:?}");
    names[1..].sort();
    assert_eq!(
        names,
        ["deploy-web-service", "deploy-docs", "restart"],
        "steps and preconditions count"
    );
    assert!(
        found[0].1 > 2.0 * found[1].1 && found[2].1 > 0.0,
        "{found:?}"
    );
    assert!(found.iter().all(|(_, score)| *score <= 1.2));
    assert_eq!(
        given
            .model
            .search(std::slice::from_ref(&team), "deploy", 1)
            .len(),
        1,
        "k limits"
    );
    assert!(
        given
            .model
            .search(std::slice::from_ref(&team), "the to a of", 10)
            .is_empty(),
        "stop words alone match nothing"
    );
    assert!(
        given
            .model
            .search(std::slice::from_ref(&team), "deploy", 0)
            .is_empty()
    );
}

#[test]
fn search_weighs_rare_terms_above_common_ones() {
    let team = scope("acme", "team-a");
    let given = Stream::given(&[
        skill(&team, "backup", "Back up the database", "2024-01-01"),
        skill(&team, "vacuum", "Vacuum the database", "2024-01-01"),
        skill(
            &team,
            "migrate",
            "Migrate the database schema",
            "2024-01-01",
        ),
        skill(
            &team,
            "helm",
            "Upgrade the kubernetes release",
            "2024-01-01",
        ),
    ]);

    let found = given
        .model
        .search(std::slice::from_ref(&team), "database on kubernetes", 10);

    assert_eq!(found[0].0.name, "helm", "{found:?}");
    assert!(found[0].1 > found[1].1 * 1.5);
}

#[test]
fn search_prefers_the_more_reliable_of_equally_relevant_skills_but_not_over_relevance() {
    let team = scope("acme", "team-a");
    let mut events = vec![
        skill(&team, "backup-fast", "Back up the database", "2024-01-01"),
        skill(&team, "backup-safe", "Back up the database", "2024-01-01"),
        skill(
            &team,
            "restore",
            "Restore the database from a backup snapshot",
            "2024-01-01",
        ),
    ];
    for _ in 0..5 {
        events.push(used(&team, "backup-fast", false, "2024-01-02"));
        events.push(used(&team, "backup-safe", true, "2024-01-02"));
    }
    for _ in 0..20 {
        events.push(used(&team, "restore", false, "2024-01-02"));
    }
    let given = Stream::given(&events);

    let backups = given
        .model
        .search(std::slice::from_ref(&team), "back up", 10);
    let restore = given
        .model
        .search(std::slice::from_ref(&team), "restore database snapshot", 10);

    let names: Vec<_> = backups.iter().map(|(s, _)| s.name.as_str()).collect();
    assert_eq!(names, ["backup-safe", "backup-fast"]);
    assert!(backups[0].1 > backups[1].1);
    assert_eq!(
        restore[0].0.name, "restore",
        "relevance beats reliability: {restore:?}"
    );
}

#[test]
fn scopes_never_mix_even_with_prefix_or_tenant_collisions() {
    let team_a = scope("acme", "team-a");
    let team_ab = scope("acme", "team-ab");
    let other_tenant = scope("globex", "team-a");
    let mut given = Stream::given(&[
        skill(&team_a, "lint", "Run the linter", "2024-01-01"),
        used(&team_ab, "lint", false, "2024-01-02"),
        used(&other_tenant, "lint", false, "2024-01-02"),
    ]);

    given
        .apply(&skill(
            &team_ab,
            "lint",
            "Run the other linter",
            "2024-01-03",
        ))
        .unwrap();
    given
        .apply(&used(&team_a, "lint", true, "2024-01-04"))
        .unwrap();

    let a = given.model.get(&team_a, "lint").unwrap();
    assert_eq!((a.successes, a.failures, a.version), (1, 0, 1));
    let ab = given.model.get(&team_ab, "lint").unwrap();
    assert_eq!(
        (ab.successes, ab.failures, ab.version),
        (0, 1, 1),
        "team-ab's own early outcome"
    );
    assert!(given.model.get(&other_tenant, "lint").is_none());
    assert_eq!(
        given
            .model
            .pending(&other_tenant, "lint")
            .unwrap()
            .unversioned
            .failures,
        1
    );
    let found = given
        .model
        .search(std::slice::from_ref(&team_a), "linter", 10);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].0.scope, team_a);
    let both = given.model.search(
        &[team_a.clone(), team_ab.clone(), team_a.clone()],
        "linter",
        10,
    );
    assert_eq!(both.len(), 2, "each scope once");
}

/// An event kind and its `content.data`.
type Payload = (EventKind, Option<Value>);

#[test]
fn malformed_payloads_are_rejected_and_change_nothing() {
    let team = scope("acme", "team-a");
    let long = "x".repeat(MAX_NAME_CHARS + 1);
    let record = |data: Value| (EventKind::SkillRecorded, Some(data));
    let cases: Vec<(Payload, Option<&str>)> = vec![
        ((EventKind::SkillRecorded, None), None),
        (record(json!(["lint"])), None),
        (record(json!({"description": "d"})), Some("name")),
        (
            record(json!({"name": " ", "description": "d"})),
            Some("name"),
        ),
        (record(json!({"name": 5, "description": "d"})), Some("name")),
        (
            record(json!({"name": long, "description": "d"})),
            Some("name"),
        ),
        (record(json!({"name": "lint"})), Some("description")),
        (
            record(json!({"name": "lint", "description": ""})),
            Some("description"),
        ),
        (
            record(json!({"name": "lint", "description": 3})),
            Some("description"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "version": 0})),
            Some("version"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "version": -1})),
            Some("version"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "version": 1.5})),
            Some("version"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "version": "2"})),
            Some("version"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "version": 4_294_967_296u64})),
            Some("version"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "steps": "run it"})),
            Some("steps"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "steps": ["ok", 1]})),
            Some("steps"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "script": 5})),
            Some("script"),
        ),
        (
            record(
                json!({"name": "lint", "description": "d", "steps": vec!["s"; engram_schema::payload::MAX_LIST_ITEMS + 1]}),
            ),
            Some("steps"),
        ),
        (
            record(json!({"name": "lint", "description": "d", "preconditions": {"a": 1}})),
            Some("preconditions"),
        ),
        (
            record(
                json!({"name": "lint", "description": "d", "observed": {"successes": 0, "failures": 0}}),
            ),
            Some("observed"),
        ),
        (
            (
                EventKind::Outcome,
                Some(json!({"skill": 5, "success": true})),
            ),
            Some("skill"),
        ),
        (
            (
                EventKind::Outcome,
                Some(json!({"skill": "", "success": true})),
            ),
            Some("skill"),
        ),
        (
            (EventKind::Outcome, Some(json!({"skill": "lint"}))),
            Some("success"),
        ),
        (
            (
                EventKind::Outcome,
                Some(json!({"skill": "lint", "success": "yes"})),
            ),
            Some("success"),
        ),
        (
            (
                EventKind::Outcome,
                Some(json!({"skill": "lint", "success": true, "version": 0})),
            ),
            Some("version"),
        ),
        (
            (
                EventKind::Outcome,
                Some(json!({"skill": "new-skill", "success": true, "version": "x"})),
            ),
            Some("version"),
        ),
    ];
    let given = Stream::given(&[
        skill(&team, "lint", "Run the linter", "2024-01-01"),
        used(&team, "pending-skill", true, "2024-01-01"),
    ]);
    let mut registry = given.model.clone();

    for ((kind, data), field) in cases {
        let bad = event(&team, kind, data.clone(), "2024-06-01");

        let err = registry
            .apply(3, &bad)
            .expect_err(&format!("{data:?} must be rejected"));

        assert_eq!(err.field(), field, "{data:?}: {err}");
        assert_eq!(err.seq(), 3);
        assert_eq!(registry, given.model, "{data:?} changed the registry");
        assert_eq!(registry.state_hash(), given.model.state_hash());
    }
    assert!(
        registry
            .apply(3, &used(&team, "lint", true, "2024-06-01"))
            .is_ok(),
        "seq not consumed"
    );
}

#[test]
fn a_version_that_would_overflow_is_rejected() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[recorded(
        &team,
        json!({"name": "lint", "version": u32::MAX, "description": "d"}),
        "2024-01-01",
    )]);
    let before = given.model.clone();

    let err = given
        .apply(&skill(&team, "lint", "next", "2024-01-02"))
        .unwrap_err();

    assert_eq!(err.field(), Some("version"));
    assert_eq!(given.model, before);
}

#[test]
fn reapplying_a_seq_is_a_no_op() {
    let team = scope("acme", "team-a");
    let mut registry = SkillRegistry::new();
    registry
        .apply(4, &skill(&team, "lint", "Run the linter", "2024-01-01"))
        .unwrap();
    let outcome = used(&team, "lint", true, "2024-01-02");
    assert_eq!(
        registry.apply(5, &outcome),
        Ok(Applied::OutcomeCounted { version: 1 })
    );
    let after_first = registry.clone();

    let again = registry.apply(5, &outcome);
    let older = registry.apply(2, &skill(&team, "lint", "older", "2024-01-01"));

    assert_eq!(again, Ok(Applied::AlreadyApplied));
    assert_eq!(older, Ok(Applied::AlreadyApplied));
    assert_eq!(registry, after_first);
    assert_eq!(registry.state_hash(), after_first.state_hash());
    assert_eq!(registry.get(&team, "lint").unwrap().successes, 1);
    assert_eq!(registry.applied_seq(), Some(5));
}
