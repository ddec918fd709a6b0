//! Given/when/then tests of the fact table's semantics.

mod common;

use common::*;
use engram_facts::{Applied, Cardinality, FactError, FactId, FactTable, MAX_TERM_CHARS};
use engram_schema::EventKind;
use serde_json::{Value, json};

fn lives_in(city: &str) -> Value {
    json!({"subject": "alice", "predicate": "lives_in", "object": city})
}

#[test]
fn identical_assertions_merge_with_provenance_and_max_confidence() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[asserted(
        &team,
        json!({"subject": "alice", "predicate": "likes", "object": "tea", "confidence": 0.6}),
        "2024-01-01",
    )]);

    let merged = given.apply(&asserted(
        &team,
        json!({"subject": " alice ", "predicate": "likes", "object": "tea", "confidence": 0.9}),
        "2024-02-01",
    ));
    let lower = given.apply(&asserted(
        &team,
        json!({"subject": "alice", "predicate": "likes", "object": "tea", "confidence": 0.3}),
        "2024-03-01",
    ));

    assert_eq!(merged, Ok(Applied::Merged(FactId(1))));
    assert_eq!(lower, Ok(Applied::Merged(FactId(1))));
    assert_eq!(given.model.len(), 1);
    let current = given.model.current(&team, Some("alice"), Some("likes"));
    assert_eq!(current.len(), 1);
    let fact = current[0];
    let seqs: Vec<_> = fact.sources.iter().map(|s| s.provenance.seq).collect();
    assert_eq!(seqs, [1, 2, 3]);
    assert_eq!(fact.confidence, 0.9, "max of the sources, not noisy-or");
    assert_eq!(fact.valid_from, t("2024-01-01"));
    assert_eq!(fact.valid_to, None);
    assert_eq!(fact.recorded_at, t("2024-01-01"));
    assert_eq!(fact.sources[1].provenance.occurred_at, t("2024-02-01"));
}

#[test]
fn a_different_object_is_not_merged() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[asserted(&team, lives_in("paris"), "2024-01-01")]);

    let applied = given.apply(&asserted(&team, lives_in("Paris"), "2024-02-01"));

    assert_eq!(applied, Ok(Applied::Created(FactId(2))), "case matters");
    assert_eq!(given.model.len(), 2);
}

#[test]
fn a_later_assertion_supersedes_a_single_valued_fact() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[asserted(&team, lives_in("london"), "2024-01-01")]);

    given
        .apply(&asserted(&team, lives_in("paris"), "2024-06-01"))
        .unwrap();

    let current = given.model.current(&team, Some("alice"), Some("lives_in"));
    assert_eq!(objects(&current), [json!("paris")]);
    let history = given.model.history(&team, "alice", "lives_in");
    assert_eq!(objects(&history), [json!("london"), json!("paris")]);
    assert_eq!(history[0].valid_to, Some(t("2024-06-01")));
    assert_eq!(history[0].superseded_by, Some(FactId(2)));
    assert_eq!(history[1].superseded_by, None);
    assert!(!history[0].is_retracted(), "superseded is not retracted");
}

#[test]
fn equal_occurred_at_goes_to_the_higher_seq() {
    let team = scope("acme", "team-a");
    for (first, second) in [("london", "paris"), ("paris", "london")] {
        let given = Stream::given(&[
            asserted(&team, lives_in(first), "2024-01-01"),
            asserted(&team, lives_in(second), "2024-01-01"),
        ]);

        let current = given.model.current(&team, Some("alice"), Some("lives_in"));

        assert_eq!(objects(&current), [json!(second)]);
        let history = given.model.history(&team, "alice", "lives_in");
        let earlier = history.iter().find(|f| f.object == json!(first)).unwrap();
        assert_eq!(earlier.superseded_by, Some(FactId(2)));
        assert_eq!(
            earlier.valid_to,
            Some(t("2024-01-01")),
            "overridden entirely"
        );
        assert!(!earlier.is_valid_at(t("2024-01-01")));
    }
}

#[test]
fn an_older_assertion_arriving_late_stays_in_history() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[asserted(&team, lives_in("paris"), "2024-06-01")]);

    let applied = given.apply(&asserted(&team, lives_in("london"), "2024-01-01"));

    assert_eq!(applied, Ok(Applied::Created(FactId(2))));
    let current = given.model.current(&team, Some("alice"), Some("lives_in"));
    assert_eq!(objects(&current), [json!("paris")]);
    let history = given.model.history(&team, "alice", "lives_in");
    assert_eq!(objects(&history), [json!("london"), json!("paris")]);
    assert_eq!(history[0].valid_to, Some(t("2024-06-01")));
    assert_eq!(history[0].superseded_by, Some(FactId(1)));
    assert_eq!(history[1].valid_to, None);
    let past = given
        .model
        .as_of(&team, t("2024-03-01"), None, Some("alice"), None);
    assert_eq!(objects(&past), [json!("london")]);
}

#[test]
fn a_late_assertion_between_two_others_cuts_both_ways_as_if_in_order() {
    let team = scope("acme", "team-a");
    let london = asserted(&team, lives_in("london"), "2024-01-01");
    let paris = asserted(&team, lives_in("paris"), "2024-05-01");
    let berlin = asserted(&team, lives_in("berlin"), "2024-09-01");
    let late = Stream::given(&[london.clone(), berlin.clone(), paris.clone()]);
    let in_order = Stream::given(&[london, paris, berlin]);

    for given in [&late, &in_order] {
        let history = given.model.history(&team, "alice", "lives_in");
        let spans: Vec<_> = history
            .iter()
            .map(|f| (f.object.clone(), f.valid_from, f.valid_to))
            .collect();
        assert_eq!(
            spans,
            [
                (json!("london"), t("2024-01-01"), Some(t("2024-05-01"))),
                (json!("paris"), t("2024-05-01"), Some(t("2024-09-01"))),
                (json!("berlin"), t("2024-09-01"), None),
            ]
        );
        let current = given.model.current(&team, Some("alice"), Some("lives_in"));
        assert_eq!(objects(&current), [json!("berlin")]);
        let by_object = |o: &str| history.iter().find(|f| f.object == json!(o)).unwrap();
        assert_eq!(
            by_object("london").superseded_by,
            Some(by_object("paris").id)
        );
        assert_eq!(
            by_object("paris").superseded_by,
            Some(by_object("berlin").id)
        );
    }
}

#[test]
fn a_later_assertion_starting_earlier_overrides_the_earlier_one_entirely() {
    let team = scope("acme", "team-a");
    let given = Stream::given(&[
        asserted(
            &team,
            json!({"subject": "alice", "predicate": "lives_in", "object": "london", "valid_from": "2022-01-01T00:00:00Z"}),
            "2024-01-01",
        ),
        asserted(
            &team,
            json!({"subject": "alice", "predicate": "lives_in", "object": "paris", "valid_from": "2020-01-01T00:00:00Z"}),
            "2024-06-01",
        ),
    ]);

    for year in ["2021-01-01", "2023-01-01"] {
        let then = given.model.as_of(&team, t(year), None, Some("alice"), None);
        assert_eq!(objects(&then), [json!("paris")], "{year}");
    }
    let london = given.model.history(&team, "alice", "lives_in")[1];
    assert_eq!(london.object, json!("london"));
    assert!(london.valid_to.unwrap() <= london.valid_from);
}

#[test]
fn a_future_value_takes_over_only_from_its_valid_from() {
    let team = scope("acme", "team-a");
    let given = Stream::given(&[
        asserted(&team, lives_in("london"), "2024-01-01"),
        asserted(
            &team,
            json!({"subject": "alice", "predicate": "lives_in", "object": "berlin", "valid_from": "2999-01-01T00:00:00Z"}),
            "2024-06-01",
        ),
    ]);

    let current = given.model.current(&team, Some("alice"), Some("lives_in"));
    assert_eq!(objects(&current), [json!("london")]);
    let later = given.model.as_of(&team, t("2999-06-01"), None, None, None);
    assert_eq!(objects(&later), [json!("berlin")]);
}

#[test]
fn a_fact_whose_valid_to_has_passed_is_not_current() {
    let team = scope("acme", "team-a");
    let given = Stream::given(&[asserted(
        &team,
        json!({"subject": "alice", "predicate": "ceo_of", "object": "acme", "valid_to": "2024-03-01T00:00:00Z"}),
        "2024-01-01",
    )]);

    assert!(given.model.current(&team, None, None).is_empty());
    let then = given.model.as_of(&team, t("2024-02-01"), None, None, None);
    assert_eq!(objects(&then), [json!("acme")]);
}

#[test]
fn multi_valued_assertions_accumulate_until_a_single_valued_one() {
    let team = scope("acme", "team-a");
    let speaks = |language: &str, cardinality: &str| json!({"subject": "bob", "predicate": "speaks", "object": language, "cardinality": cardinality});
    let mut given = Stream::given(&[
        asserted(&team, speaks("english", "multi"), "2024-01-01"),
        asserted(&team, speaks("french", "multi"), "2024-02-01"),
        asserted(&team, speaks("german", "multi"), "2024-03-01"),
    ]);
    let current = given.model.current(&team, Some("bob"), Some("speaks"));
    assert_eq!(
        objects(&current),
        [json!("english"), json!("french"), json!("german")]
    );
    assert!(current.iter().all(|f| f.cardinality == Cardinality::Multi));

    given
        .apply(&asserted(&team, speaks("spanish", "single"), "2024-04-01"))
        .unwrap();

    let current = given.model.current(&team, Some("bob"), Some("speaks"));
    assert_eq!(objects(&current), [json!("spanish")]);
    assert_eq!(given.model.history(&team, "bob", "speaks").len(), 4);
}

#[test]
fn retracting_the_superseding_value_reopens_the_previous_one() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[
        asserted(&team, lives_in("london"), "2024-01-01"),
        asserted(&team, lives_in("paris"), "2024-06-01"),
    ]);

    let applied = given.apply(&retracted(
        &team,
        json!({"subject": "alice", "predicate": "lives_in", "object": "paris"}),
        "2024-08-01",
    ));

    assert_eq!(applied, Ok(Applied::Retracted(vec![FactId(2)])));
    let current = given.model.current(&team, Some("alice"), Some("lives_in"));
    assert_eq!(objects(&current), [json!("london")]);
    assert_eq!(current[0].valid_to, None);
    assert_eq!(current[0].superseded_by, None);
    let history = given.model.history(&team, "alice", "lives_in");
    let paris = history[1];
    assert_eq!(paris.retracted_at, Some(t("2024-08-01")));
    assert_eq!(paris.retracted_by.as_ref().map(|p| p.seq), Some(3));
    assert_eq!(paris.valid_to, None, "retraction leaves valid time alone");
    let believed_then =
        given
            .model
            .as_of(&team, t("2024-07-01"), Some(t("2024-07-01")), None, None);
    assert_eq!(objects(&believed_then), [json!("paris")]);
}

#[test]
fn a_retraction_without_object_retracts_every_believed_object() {
    let team = scope("acme", "team-a");
    let speaks = |language: &str| json!({"subject": "bob", "predicate": "speaks", "object": language, "cardinality": "multi"});
    let mut given = Stream::given(&[
        asserted(&team, speaks("english"), "2024-01-01"),
        asserted(&team, speaks("french"), "2024-02-01"),
        asserted(&team, lives_in("london"), "2024-02-01"),
    ]);

    let applied = given.apply(&retracted(
        &team,
        json!({"subject": "bob", "predicate": "speaks"}),
        "2024-03-01",
    ));

    assert_eq!(applied, Ok(Applied::Retracted(vec![FactId(1), FactId(2)])));
    assert!(given.model.current(&team, Some("bob"), None).is_empty());
    assert_eq!(given.model.current(&team, Some("alice"), None).len(), 1);
    let history = given.model.history(&team, "bob", "speaks");
    assert_eq!(history.len(), 2);
    assert!(history.iter().all(|f| f.is_retracted()));
}

#[test]
fn a_reassertion_after_retraction_is_a_new_fact() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[
        asserted(&team, lives_in("london"), "2024-01-01"),
        retracted(
            &team,
            json!({"subject": "alice", "predicate": "lives_in"}),
            "2024-02-01",
        ),
    ]);

    let applied = given.apply(&asserted(&team, lives_in("london"), "2024-03-01"));

    assert_eq!(applied, Ok(Applied::Created(FactId(3))));
    let current = given.model.current(&team, Some("alice"), None);
    assert_eq!(
        current.iter().map(|f| f.id).collect::<Vec<_>>(),
        [FactId(3)]
    );
}

#[test]
fn a_retraction_matching_nothing_changes_no_fact() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[asserted(&team, lives_in("london"), "2024-01-01")]);
    let before = given.model.history(&team, "alice", "lives_in")[0].clone();

    let other_object = given.apply(&retracted(
        &team,
        json!({"subject": "alice", "predicate": "lives_in", "object": "paris"}),
        "2024-02-01",
    ));
    let other_subject = given.apply(&retracted(
        &team,
        json!({"subject": "carol", "predicate": "lives_in"}),
        "2024-02-01",
    ));

    assert_eq!(other_object, Ok(Applied::Retracted(vec![])));
    assert_eq!(other_subject, Ok(Applied::Retracted(vec![])));
    assert_eq!(given.model.history(&team, "alice", "lives_in"), [&before]);
}

#[test]
fn as_of_answers_for_each_valid_time_and_known_time() {
    let team = scope("acme", "team-a");
    let at = |object: &str, valid_from: &str| json!({"subject": "alice", "predicate": "lives_in", "object": object, "valid_from": t(valid_from).to_rfc3339()});
    let given = Stream::given(&[
        asserted(&team, at("london", "2020-01-01"), "2024-01-01"),
        asserted(&team, at("paris", "2022-01-01"), "2024-03-01"),
        retracted(
            &team,
            json!({"subject": "alice", "predicate": "lives_in", "object": "paris"}),
            "2024-05-01",
        ),
        asserted(&team, at("berlin", "2023-01-01"), "2024-07-01"),
    ]);
    let cases: &[(&str, Option<&str>, &[&str])] = &[
        ("2019-06-01", None, &[]),
        ("2021-06-01", None, &["london"]),
        ("2022-06-01", None, &["london"]),
        ("2023-06-01", None, &["berlin"]),
        ("2021-06-01", Some("2023-12-31"), &[]),
        ("2022-06-01", Some("2024-02-01"), &["london"]),
        ("2022-06-01", Some("2024-03-01"), &["paris"]),
        ("2022-06-01", Some("2024-04-30"), &["paris"]),
        ("2022-06-01", Some("2024-05-01"), &["london"]),
        ("2023-06-01", Some("2024-06-01"), &["london"]),
        ("2023-06-01", Some("2024-07-01"), &["berlin"]),
        ("2022-06-01", Some("2024-07-01"), &["london"]),
    ];

    for (valid_at, known_at, expected) in cases {
        let found = given.model.as_of(
            &team,
            t(valid_at),
            known_at.map(t),
            Some("alice"),
            Some("lives_in"),
        );
        let expected: Vec<Value> = expected.iter().map(|o| json!(o)).collect();
        assert_eq!(
            objects(&found),
            expected,
            "valid at {valid_at}, known at {known_at:?}"
        );
        if known_at.is_none() {
            let known_later =
                given
                    .model
                    .as_of(&team, t(valid_at), Some(t("2999-01-01")), None, None);
            assert_eq!(
                objects(&known_later),
                expected,
                "latest knowledge computed two ways"
            );
        }
    }
}

#[test]
fn scopes_never_mix_even_with_prefix_or_tenant_collisions() {
    let team_a = scope("acme", "team-a");
    let team_ab = scope("acme", "team-ab");
    let other_tenant = scope("globex", "team-a");
    let mut given = Stream::given(&[
        asserted(&team_a, lives_in("london"), "2024-01-01"),
        asserted(&team_ab, lives_in("paris"), "2024-02-01"),
    ]);

    let same_claim = given.apply(&asserted(&other_tenant, lives_in("london"), "2024-03-01"));
    given
        .apply(&retracted(
            &team_ab,
            json!({"subject": "alice", "predicate": "lives_in"}),
            "2024-04-01",
        ))
        .unwrap();

    assert_eq!(
        same_claim,
        Ok(Applied::Created(FactId(3))),
        "no merge across tenants"
    );
    let in_a = given.model.current(&team_a, None, None);
    assert_eq!(objects(&in_a), [json!("london")]);
    assert_eq!(in_a[0].id, FactId(1));
    assert!(in_a[0].superseded_by.is_none());
    assert!(given.model.current(&team_ab, None, None).is_empty());
    assert_eq!(
        given.model.current(&other_tenant, None, None)[0].id,
        FactId(3)
    );
    let found = given
        .model
        .search(std::slice::from_ref(&team_a), "alice paris london", 10);
    assert_eq!(
        found.iter().map(|(f, _)| f.id).collect::<Vec<_>>(),
        [FactId(1)]
    );
    assert!(given.model.history(&team_a, "alice", "lives_in").len() == 1);
}

#[test]
fn malformed_payloads_are_rejected_and_change_nothing() {
    let team = scope("acme", "team-a");
    let long = "x".repeat(MAX_TERM_CHARS + 1);
    let too_deep = (0..=engram_schema::payload::MAX_OBJECT_DEPTH).fold(json!(1), |v, _| json!([v]));
    let cases: Vec<(EventKind, Option<Value>, Option<&str>)> = vec![
        (EventKind::FactAsserted, None, None),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p", "object": too_deep})),
            Some("object"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!("alice lives in paris")),
            None,
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"predicate": "p", "object": 1})),
            Some("subject"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "  ", "predicate": "p", "object": 1})),
            Some("subject"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": 7, "predicate": "p", "object": 1})),
            Some("subject"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": long, "predicate": "p", "object": 1})),
            Some("subject"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "object": 1})),
            Some("predicate"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p"})),
            Some("object"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p", "object": null})),
            Some("object"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p", "object": 1, "valid_from": 2024})),
            Some("valid_from"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p", "object": 1, "valid_from": "yesterday"})),
            Some("valid_from"),
        ),
        (
            EventKind::FactAsserted,
            Some(
                json!({"subject": "s", "predicate": "p", "object": 1, "valid_from": "2024-02-01T00:00:00Z", "valid_to": "2024-02-01T00:00:00Z"}),
            ),
            Some("valid_to"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p", "object": 1, "confidence": 1.5})),
            Some("confidence"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p", "object": 1, "confidence": "high"})),
            Some("confidence"),
        ),
        (
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p", "object": 1, "cardinality": "many"})),
            Some("cardinality"),
        ),
        (
            EventKind::FactRetracted,
            Some(json!({"subject": "alice"})),
            Some("predicate"),
        ),
        (EventKind::FactRetracted, None, None),
    ];
    let mut given = Stream::given(&[asserted(&team, lives_in("london"), "2024-01-01")]);
    let before = given.model.clone();

    for (kind, data, field) in cases {
        let mut bad = event(&team, kind, json!({}), "2024-06-01");
        bad.content.data = data.clone();

        let result = given.model.apply(2, &bad);

        let err = result.expect_err(&format!("{data:?} must be rejected"));
        assert_eq!(err.field(), field, "{data:?}: {err}");
        assert_eq!(err.seq(), 2);
        if let FactError::InvalidField { reason, .. } = &err {
            assert!(!reason.is_empty());
        }
        assert_eq!(given.model, before, "{data:?} changed the table");
        assert_eq!(given.model.state_hash(), before.state_hash());
    }
    // The seq was not consumed: a good event can still take it.
    assert!(
        given
            .model
            .apply(2, &asserted(&team, lives_in("paris"), "2024-06-01"))
            .is_ok()
    );
}

#[test]
fn terms_are_trimmed_and_limited_in_characters_not_bytes() {
    let team = scope("acme", "team-a");
    let subject = "é".repeat(MAX_TERM_CHARS);
    let given = Stream::given(&[asserted(
        &team,
        json!({"subject": format!("  {subject}\n"), "predicate": "Likes", "object": {"drink": "tea", "sugar": false}}),
        "2024-01-01",
    )]);

    assert_eq!(
        given
            .model
            .current(&team, Some(&subject), Some("Likes"))
            .len(),
        1
    );
    assert!(
        given
            .model
            .current(&team, Some(&subject), Some("likes"))
            .is_empty()
    );
}

#[test]
fn reapplying_a_seq_is_a_no_op() {
    let team = scope("acme", "team-a");
    let mut table = FactTable::new();
    let event = asserted(&team, lives_in("london"), "2024-01-01");
    assert_eq!(table.apply(5, &event), Ok(Applied::Created(FactId(5))));
    let after_first = table.clone();

    let again = table.apply(5, &event);
    let older = table.apply(3, &asserted(&team, lives_in("paris"), "2024-06-01"));

    assert_eq!(again, Ok(Applied::AlreadyApplied));
    assert_eq!(older, Ok(Applied::AlreadyApplied));
    assert_eq!(table, after_first);
    assert_eq!(table.state_hash(), after_first.state_hash());
    assert_eq!(table.applied_seq(), Some(5));
    assert_eq!(table.current(&team, None, None)[0].sources.len(), 1);
}

#[test]
fn other_event_kinds_are_ignored_but_move_the_applied_seq() {
    let team = scope("acme", "team-a");
    let mut table = FactTable::new();
    let empty_hash = table.state_hash();

    let applied = table.apply(
        1,
        &event(
            &team,
            EventKind::Observation,
            json!({"subject": 1}),
            "2024-01-01",
        ),
    );

    assert_eq!(applied, Ok(Applied::Ignored));
    assert!(table.is_empty());
    assert_eq!(table.applied_seq(), Some(1));
    assert_ne!(
        table.state_hash(),
        empty_hash,
        "the applied seq is part of the state"
    );
}

#[test]
fn search_ranks_current_facts_by_word_overlap() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[
        asserted(&team, lives_in("Paris"), "2024-01-01"),
        asserted(
            &team,
            json!({"subject": "alice", "predicate": "works_at", "object": {"company": "Acme Corp"}}),
            "2024-01-01",
        ),
        asserted(
            &team,
            json!({"subject": "bob", "predicate": "lives_in", "object": "London"}),
            "2024-01-01",
        ),
    ]);

    let found = given.model.search(
        std::slice::from_ref(&team),
        "Where does Alice live? Paris?",
        10,
    );
    let ranked: Vec<_> = found
        .iter()
        .map(|(f, s)| (f.predicate.as_str(), *s))
        .collect();
    assert_eq!(ranked.len(), 2, "{ranked:?}");
    assert_eq!(ranked[0].0, "lives_in");
    assert_eq!(ranked[1].0, "works_at");
    assert!(ranked[0].1 > ranked[1].1);
    let by_key = given
        .model
        .search(std::slice::from_ref(&team), "company", 10);
    assert_eq!(by_key.len(), 1, "object keys count");
    assert_eq!(
        given
            .model
            .search(std::slice::from_ref(&team), "alice", 1)
            .len(),
        1,
        "k limits"
    );
    assert!(
        given
            .model
            .search(std::slice::from_ref(&team), "?!", 10)
            .is_empty()
    );

    given
        .apply(&asserted(&team, lives_in("Berlin"), "2024-06-01"))
        .unwrap();

    assert!(
        given.model.search(&[team], "paris", 10).is_empty(),
        "superseded facts are not searched"
    );
}

#[test]
fn a_repeated_assertion_with_narrower_validity_neither_splits_nor_shortens_the_fact() {
    let team = scope("acme", "team-a");
    let mut given = Stream::given(&[asserted(
        &team,
        json!({"subject": "alice", "predicate": "lives_in", "object": "london", "valid_from": "2020-01-01T00:00:00Z"}),
        "2024-01-01",
    )]);

    let applied = given.apply(&asserted(
        &team,
        json!({"subject": "alice", "predicate": "lives_in", "object": "london", "valid_from": "2021-01-01T00:00:00Z", "valid_to": "2022-01-01T00:00:00Z"}),
        "2024-02-01",
    ));

    assert_eq!(applied, Ok(Applied::Merged(FactId(1))));
    let current = given.model.current(&team, Some("alice"), Some("lives_in"));
    assert_eq!(objects(&current), [json!("london")]);
    assert_eq!(
        current[0].valid_to, None,
        "validity is the union of the sources'"
    );
    assert!(current[0].is_valid_at(t("2023-01-01")));
}
