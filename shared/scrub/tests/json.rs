//! `scrub_json`: every string of a JSON value, with object keys as names.

mod common;

use common::*;
use engram_scrub::{Kind, Scrubber, scrub_json};
use serde_json::json;

#[test]
fn strings_are_scrubbed_in_place_in_document_order() {
    let gh = github(1);
    let aws = aws_access(2);
    let mut v = json!({
        "a": format!("push with {gh}"),
        "b": [1, true, null, format!("id {aws}"), {"c": "password=hunter2"}],
        "d": 3.5,
        "e": "nothing to see",
    });
    let kinds = scrub_json(&Scrubber::default(), &mut v);
    assert_eq!(
        kinds,
        [Kind::GithubToken, Kind::AwsAccessKey, Kind::KeyValueSecret]
    );
    assert_eq!(
        v,
        json!({
            "a": "push with [REDACTED:github_token]",
            "b": [1, true, null, "id [REDACTED:aws_access_key]", {"c": "password=[REDACTED:key_value_secret]"}],
            "d": 3.5,
            "e": "nothing to see",
        })
    );
    // Idempotent.
    let before = v.clone();
    assert!(scrub_json(&Scrubber::default(), &mut v).is_empty());
    assert_eq!(v, before);
}

#[test]
fn an_object_key_names_its_value() {
    let secret = aws_secret(3);
    let token = random_token(32, 4);
    let mut v = json!({
        "password": "hunter2",
        "client_secret": "abcd1234efgh",
        "aws_secret_access_key": secret,
        "deploy_key": token,
        "token": "none",
        "api_key": "<your key here>",
        "password_min_length": "123456789",
        "user": "hunter2",
        "key": "sort-by-created-at",
        "ghp_keys_are_not_scrubbed": 1,
    });
    let kinds = scrub_json(&Scrubber::default(), &mut v);
    // serde_json's map is sorted by key: that is the document order here.
    assert_eq!(
        kinds,
        [
            Kind::AwsSecretKey,
            Kind::KeyValueSecret,
            Kind::HighEntropy,
            Kind::KeyValueSecret
        ]
    );
    assert_eq!(v["password"], "[REDACTED:key_value_secret]");
    assert_eq!(v["client_secret"], "[REDACTED:key_value_secret]");
    assert_eq!(v["aws_secret_access_key"], "[REDACTED:aws_secret_key]");
    assert_eq!(v["deploy_key"], "[REDACTED:high_entropy]");
    for (k, unchanged) in [
        ("token", "none"),
        ("api_key", "<your key here>"),
        ("password_min_length", "123456789"),
        ("user", "hunter2"),
        ("key", "sort-by-created-at"),
    ] {
        assert_eq!(v[k], unchanged, "{k}");
    }
}

#[test]
fn a_specific_kind_still_wins_inside_a_named_value() {
    let gh = github(5);
    let mut v = json!({"token": gh});
    assert_eq!(
        scrub_json(&Scrubber::default(), &mut v),
        [Kind::GithubToken]
    );
    assert_eq!(v, json!({"token": "[REDACTED:github_token]"}));
}

#[test]
fn deep_values_are_reached_without_recursion() {
    let gh = github(6);
    let mut v = json!(format!("x {gh}"));
    for i in 0..10_000 {
        // Not `json!`, which would serialise `v` again, recursively.
        v = if i % 2 == 0 {
            serde_json::Value::Array(vec![v])
        } else {
            serde_json::Value::Object([("k".to_owned(), v)].into_iter().collect())
        };
    }
    assert_eq!(
        scrub_json(&Scrubber::default(), &mut v),
        [Kind::GithubToken]
    );
    let mut inner = &v;
    while let Some(next) = inner.get(0).or_else(|| inner.get("k")) {
        inner = next;
    }
    assert_eq!(inner, "x [REDACTED:github_token]");
    // Dropping a deeply nested value recurses inside serde_json: unwind it by hand.
    let mut stack = vec![v];
    while let Some(mut v) = stack.pop() {
        match &mut v {
            serde_json::Value::Array(a) => stack.append(a),
            serde_json::Value::Object(m) => {
                stack.extend(std::mem::take(m).into_iter().map(|(_, v)| v))
            }
            _ => {}
        }
    }
}
