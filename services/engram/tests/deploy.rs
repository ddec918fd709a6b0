//! The files in `deploy/` against the engram they deploy: every metric the Grafana dashboard
//! and the Prometheus alerts query is one a running `engram up` exports (a renamed or
//! misspelt metric fails here, naming it and where it is used), the NATS configs route
//! queries exactly as engram renders the mapping, and the image pre-fetches the model and runs
//! a nats-server engram accepts. `deploy/check` checks the same files' syntax with promtool,
//! kubernetes-validate, nats-server and docker compose.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{cli, http_exchange, ok, spawn_up, token};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(relative: &str) -> String {
    let path = repo().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// PromQL's aggregation operators: followed by `by (...)` or `(`, never a metric.
const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
/// Binary operators and other keywords that read like identifiers.
const KEYWORDS: &[&str] = &[
    "and", "or", "unless", "offset", "bool", "atan2", "inf", "nan",
];

/// The metric names a PromQL expression reads: its identifiers, less function and
/// aggregation names (an identifier followed by `(`), keywords, label names (inside `{...}`
/// and the lists after `by`, `on` and the like), strings, numbers, durations and ranges
/// (`[$__rate_interval]`), and Grafana variables.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    // The index just past the bracket that closes the one at `open`, skipping strings.
    let close = |open: usize, closing: char| -> usize {
        let opening = chars[open];
        let (mut depth, mut i) = (0usize, open);
        while i < chars.len() {
            match chars[i] {
                q @ ('"' | '\'' | '`') => {
                    i += 1;
                    while i < chars.len() && chars[i] != q {
                        i += if chars[i] == '\\' { 2 } else { 1 };
                    }
                }
                c if c == opening => depth += 1,
                c if c == closing => {
                    depth -= 1;
                    if depth == 0 {
                        return i + 1;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        panic!("unbalanced {opening} in {expr:?}");
    };
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i += 1;
            while i < chars.len() && chars[i] != c {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == '{' {
            i = close(i, '}');
        } else if c == '[' {
            i = close(i, ']');
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c.is_ascii_digit() || c == '.' || c == '$' {
            // A number or a duration (0.99, 1e3, 5m), or a Grafana variable ($__interval).
            i += 1;
            while i < chars.len() && (ident(chars[i]) || chars[i] == '.') {
                i += 1;
            }
        } else if ident(c) {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let called = next < chars.len() && chars[next] == '(';
            if LABEL_LISTS.contains(&word.as_str()) {
                if called {
                    i = close(next, ')');
                }
            } else if !called
                && !AGGREGATIONS.contains(&word.as_str())
                && !KEYWORDS.contains(&word.as_str())
            {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Every `expr` of the dashboard, with its panel's title.
fn dashboard_exprs(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(value: &serde_json::Value, panel: &str, out: &mut Vec<(String, String)>) {
        match value {
            serde_json::Value::Object(map) => {
                let panel = map
                    .get("title")
                    .and_then(|t| t.as_str())
                    .unwrap_or(panel)
                    .to_owned();
                for (key, v) in map {
                    match (key.as_str(), v) {
                        ("expr", serde_json::Value::String(expr)) => {
                            out.push((format!("dashboard panel {panel:?}"), expr.clone()));
                        }
                        _ => walk(v, &panel, out),
                    }
                }
            }
            serde_json::Value::Array(items) => {
                for item in items {
                    walk(item, panel, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dashboard, "", &mut out);
    out
}

/// Every rule's `expr` in a Prometheus rules file, with its alert's name. The file is read by
/// lines (this crate has no YAML parser): an `expr:` holds its expression on the same line or,
/// after `|` or `>`, on the lines indented deeper below it.
fn rule_exprs(text: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let indent = |line: &str| line.len() - line.trim_start().len();
    let mut out = Vec::new();
    let mut rule = String::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if let Some(name) = trimmed
            .strip_prefix("- alert:")
            .or_else(|| trimmed.strip_prefix("- record:"))
        {
            rule = name.trim().to_owned();
        }
        if let Some(rest) = trimmed.strip_prefix("expr:") {
            let rest = rest.trim();
            let expr = if matches!(rest, "|" | "|-" | ">" | ">-") {
                let mut block = Vec::new();
                while i + 1 < lines.len()
                    && (lines[i + 1].trim().is_empty() || indent(lines[i + 1]) > indent(line))
                {
                    i += 1;
                    block.push(lines[i].trim());
                }
                block.join("\n")
            } else {
                rest.trim_matches(|c| c == '"' || c == '\'').to_owned()
            };
            out.push((format!("alert {rule}"), expr));
        }
        i += 1;
    }
    out
}

/// The metric families a Prometheus text exposition declares, with their types.
fn families(exposition: &str) -> BTreeMap<String, String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let (name, kind) = l.split_once(' ')?;
            Some((name.to_owned(), kind.trim().to_owned()))
        })
        .collect()
}

/// The family that exports `name`: itself, or the histogram (or summary) whose `_bucket`,
/// `_sum` or `_count` series it is.
fn exported<'a>(name: &str, families: &'a BTreeMap<String, String>) -> Option<&'a str> {
    if let Some((family, _)) = families.get_key_value(name) {
        return Some(family);
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = name.strip_suffix(suffix)?;
        let (family, kind) = families.get_key_value(base)?;
        let has_it = kind == "histogram" || (kind == "summary" && *suffix != "_bucket");
        has_it.then_some(family.as_str())
    })
}

/// Whether a series comes from somewhere else than engram, and so is not checked here:
/// `nats_*` is the NATS Prometheus exporter's (its `-prefix=nats`, which the Helm chart
/// passes and compose copies; engram exports nothing by that prefix, and only the dashboard's
/// NATS panels read them); `up` is written by Prometheus for every target it scrapes.
fn from_elsewhere(name: &str) -> bool {
    name.starts_with("nats_") || name == "up"
}

#[test]
fn the_expression_parsers_find_metrics_and_nothing_else() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (op, le) (rate(engram_query_seconds_bucket{op=~"retrieve|context", x="a{b}"}[$__rate_interval] offset 5m))) > 1
        and on (instance) max without (projector) (label_replace(engram_projector_lag_events, "partition", "$1", "projector", ".*-p([0-9]+)$")) / up"#,
    );
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "engram_projector_lag_events",
            "engram_query_seconds_bucket",
            "up"
        ]
    );
    let rules = rule_exprs(
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: engram_a > 1\n        for: 1m\n      - alert: B\n        expr: |\n          engram_b\n            / engram_c\n        labels:\n          severity: x\n",
    );
    assert_eq!(
        rules,
        [
            ("alert A".to_owned(), "engram_a > 1".to_owned()),
            ("alert B".to_owned(), "engram_b\n/ engram_c".to_owned()),
        ]
    );
    let exposition = "# HELP a_seconds x\n# TYPE a_seconds histogram\na_seconds_bucket{le=\"1\"} 0\n# TYPE b_total counter\nb_total 1\n";
    let families = families(exposition);
    assert_eq!(exported("a_seconds_bucket", &families), Some("a_seconds"));
    assert_eq!(exported("a_seconds_count", &families), Some("a_seconds"));
    assert_eq!(exported("b_total", &families), Some("b_total"));
    assert_eq!(exported("b_total_count", &families), None);
    assert_eq!(exported("engram_no_such_metric", &families), None);
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_query_is_one_engram_exports() {
    // Given every expression of the dashboard and the alert rules
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/engram.json")).expect("dashboard json");
    let mut exprs = dashboard_exprs(&dashboard);
    let panels = exprs.len();
    assert!(panels >= 20, "only {panels} dashboard queries found");
    let alerts = read("deploy/prometheus/alerts.yml");
    let rules = rule_exprs(&alerts);
    let declared = alerts
        .lines()
        .filter(|l| {
            let l = l.trim_start();
            l.starts_with("- alert:") || l.starts_with("- record:")
        })
        .count();
    assert_eq!(
        rules.len(),
        declared,
        "each rule of alerts.yml should have one expr the reader finds"
    );
    exprs.extend(rules);
    let mut used: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (place, expr) in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{place} reads no metric: {expr}");
        for name in names {
            used.entry(name).or_default().insert(place.clone());
        }
    }
    for signal in [
        "engram_stream_last_seq",
        "engram_projector_lag_events",
        "engram_query_seconds_bucket",
        "engram_projector_dead_lettered_total",
        "engram_node_partitions_owned",
        "engram_snapshot_seconds_count",
        "engram_projector_visibility_seconds_bucket",
        "engram_snapshot_last_timestamp_seconds",
        "engram_snapshot_last_seq",
        "engram_projector_redelivered_total",
        "engram_stream_leader_changes_total",
        "engram_node_partition_owned",
    ] {
        assert!(used.contains_key(signal), "nothing reads {signal}");
    }

    // When engram up runs and has appended, applied, answered a query and cut a snapshot
    // (labelled series appear at their first use: the query, stage and snapshot ones, and
    // written-to-readable once an event written while it runs is visible, which the query
    // waits for)
    let home = tempfile::tempdir().unwrap();
    let (_up, ready) = spawn_up(home.path(), &["--nats-port", "0"], Duration::from_secs(120));
    let http = token(&ready, "http=http://").to_owned();
    let nats = token(&ready, "nats=").to_owned();
    let mut seq = String::new();
    for text in [
        "login fails with a 500 after the deploy",
        "the login service runs on postgres 16",
    ] {
        let receipt = ok(cli(home.path()).args([
            "--nats", &nats, "--json", "append", "--tenant", "acme", "--scope", "task:t1",
            "--text", text,
        ]));
        let receipt: serde_json::Value = serde_json::from_str(&receipt).unwrap();
        seq = receipt["seq"].as_u64().expect("a seq").to_string();
    }
    let found = ok(cli(home.path()).args([
        "--nats",
        &nats,
        "--json",
        "retrieve",
        "login",
        "--tenant",
        "acme",
        "--scope",
        "task:t1",
        "--mode",
        "keyword",
        "--min-seq",
        &seq,
        "--wait-ms",
        "60000",
    ]));
    assert!(found.contains("login fails"), "{found}");
    let cut = ok(cli(home.path()).args(["--nats", &nats, "snapshot", "create", "facts"]));
    assert!(cut.contains("cut "), "{cut}");
    let (status, exposition) = http_exchange(&http, &http, "GET /metrics HTTP/1.1", "");
    assert_eq!(status, 200, "{exposition}");
    let families = families(&exposition);
    assert!(
        families.len() > 20,
        "few metric families in /metrics: {exposition}"
    );

    // Then each metric they read is exported (or comes from the NATS exporter or Prometheus)
    let missing: Vec<String> = used
        .iter()
        .filter(|(name, _)| !from_elsewhere(name) && exported(name, &families).is_none())
        .map(|(name, places)| {
            let places: Vec<&str> = places.iter().map(String::as_str).collect();
            format!("{name} (used by {})", places.join(", "))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "deploy/ queries metrics engram does not export:\n  {}\nexported: {:?}",
        missing.join("\n  "),
        families.keys().collect::<Vec<_>>()
    );
}

#[test]
fn the_nats_configs_route_queries_to_memory_nodes_as_engram_renders_it() {
    // The compose servers' config and the Helm values carry the mapping `engram up` writes
    // for its own server, for the partition count of the deployment's engram.toml.
    let compose_toml: toml::Table = toml::from_str(&read("deploy/compose/engram.toml")).unwrap();
    let partitions = compose_toml["bus"]["stream"]["partitions"]
        .as_integer()
        .expect("bus.stream.partitions in deploy/compose/engram.toml");
    let k8s_config = read("deploy/k8s/engram/configmap.yaml");
    assert!(
        k8s_config.contains(&format!("partitions = {partitions}")),
        "deploy/k8s/engram/configmap.yaml should set bus.stream.partitions = {partitions}"
    );
    let rendered = engram_access::conf::query_routing(u32::try_from(partitions).unwrap());
    let routes: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('"'))
        .collect();
    assert_eq!(routes.len(), 2, "{rendered}");
    for file in ["deploy/compose/nats.conf", "deploy/k8s/nats-values.yaml"] {
        let text = read(file);
        for route in &routes {
            assert!(text.contains(route), "{file} lacks `{route}`");
        }
    }
}

#[test]
fn the_image_carries_the_model_engram_loads_and_a_nats_server_it_accepts() {
    // The model: the Dockerfile's build arguments are engram-embed's constants, so the image
    // never fetches it at run time (it has no pip to).
    let minilm = read("shared/embed/src/minilm.rs");
    let constant = |name: &str| -> String {
        let line = minilm
            .lines()
            .find(|l| l.starts_with(&format!("const {name}: &str = ")))
            .unwrap_or_else(|| panic!("no {name} in shared/embed/src/minilm.rs"));
        line.split('"').nth(1).unwrap().to_owned()
    };
    let dockerfile = read("deploy/Dockerfile");
    let arg = |name: &str| -> String {
        dockerfile
            .lines()
            .find_map(|l| l.strip_prefix(&format!("ARG {name}=")))
            .unwrap_or_else(|| panic!("no ARG {name}= in deploy/Dockerfile"))
            .trim()
            .to_owned()
    };
    assert_eq!(arg("MODEL_PACKAGE"), constant("WHEEL_PACKAGE"));
    assert_eq!(arg("MODEL_VERSION"), constant("WHEEL_VERSION"));
    assert_eq!(arg("MODEL_DIR"), constant("WHEEL_MODEL_DIR"));

    // The nats-server: one image everywhere, of a version engram runs with.
    let image = arg("NATS_IMAGE");
    let compose = read("deploy/compose/docker-compose.yml");
    assert!(
        compose.contains(&format!("image: {image}")),
        "docker-compose.yml runs another nats image than {image}"
    );
    let tag = image.strip_prefix("nats:").expect("a nats image");
    let values = read("deploy/k8s/nats-values.yaml");
    assert!(
        values.contains(&format!("tag: {tag}")),
        "nats-values.yaml runs another nats image than {image}"
    );
    let version: Vec<u32> = tag
        .split(['-', '.'])
        .take(3)
        .map(|p| p.parse().unwrap())
        .collect();
    let (major, minor, patch) = engram_natsd::MIN_VERSION;
    assert!(
        (version[0], version[1], version[2]) >= (major, minor, patch),
        "{image} is older than engram's minimum nats-server {major}.{minor}.{patch}"
    );
}
