//! The target's Prometheus metrics, read over HTTP at the edges of the run: what only the
//! processes under test can measure (consolidation runs, a projector's batch time) comes
//! from here, as differences between two scrapes.
//!
//! A plain HTTP/1.1 GET on a TCP stream is all a scrape needs; no HTTP client is pulled in.
//! Only `http://` URLs are read.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One scrape: every sample, by metric name and labels.
#[derive(Clone, Debug, Default)]
pub(crate) struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

impl Scrape {
    /// Parses the Prometheus text exposition format (comments and blank lines skipped).
    pub(crate) fn parse(text: &str) -> Self {
        let mut samples = Vec::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (series, value) = match line.rsplit_once(' ') {
                Some(parts) => parts,
                None => continue,
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, parse_labels(rest.trim_end_matches('}'))),
                None => (series, BTreeMap::new()),
            };
            samples.push((name.to_owned(), labels, value));
        }
        Self { samples }
    }

    /// The sum of `name`'s samples whose labels include `labels`; `None` if it has none.
    pub(crate) fn sum(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut found = None;
        for (n, l, v) in &self.samples {
            if n == name && matches(l, labels) {
                *found.get_or_insert(0.0) += v;
            }
        }
        found
    }

    /// A histogram's cumulative buckets (`le`, count), `+Inf` last.
    pub(crate) fn buckets(&self, name: &str, labels: &[(&str, &str)]) -> Vec<(f64, f64)> {
        let bucket = format!("{name}_bucket");
        let mut out: Vec<(f64, f64)> = self
            .samples
            .iter()
            .filter(|(n, l, _)| *n == bucket && matches(l, labels))
            .filter_map(|(_, l, v)| {
                let le = l.get("le")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, *v))
            })
            .collect();
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        // Several series (a model's partitions) add up bound by bound.
        out.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 += later.1;
            }
            same
        });
        out
    }
}

/// Whether a sample's labels include `wanted`. A read model runs one instance per stream
/// partition, labelled `<model>-p<partition>`: asking for `projector="docs"` takes every
/// instance of docs.
fn matches(labels: &BTreeMap<String, String>, wanted: &[(&str, &str)]) -> bool {
    wanted.iter().all(|(k, want)| {
        labels.get(*k).is_some_and(|have| {
            have == want
                || (*k == "projector"
                    && have
                        .strip_prefix(want)
                        .and_then(|rest| rest.strip_prefix("-p"))
                        .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())))
        })
    })
}

/// What a histogram gained between two scrapes.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct HistogramDelta {
    pub(crate) count: f64,
    pub(crate) sum: f64,
    /// Cumulative counts by upper bound, ascending.
    buckets: Vec<(f64, f64)>,
}

impl HistogramDelta {
    pub(crate) fn between(
        before: &Scrape,
        after: &Scrape,
        name: &str,
        labels: &[(&str, &str)],
    ) -> Option<Self> {
        let count = after.sum(&format!("{name}_count"), labels)?;
        let sum = after.sum(&format!("{name}_sum"), labels)?;
        let earlier = before.buckets(name, labels);
        let buckets = after
            .buckets(name, labels)
            .into_iter()
            .map(|(le, n)| {
                let was = earlier
                    .iter()
                    .find(|(l, _)| *l == le)
                    .map_or(0.0, |(_, n)| *n);
                (le, n - was)
            })
            .collect();
        Some(Self {
            count: count - before.sum(&format!("{name}_count"), labels).unwrap_or(0.0),
            sum: sum - before.sum(&format!("{name}_sum"), labels).unwrap_or(0.0),
            buckets,
        })
    }

    /// The upper bound of the bucket holding quantile `q`: the value is at most this. `None`
    /// with no observations, or past the last finite bound.
    pub(crate) fn quantile_bound(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = (q * self.count).ceil().max(1.0);
        self.buckets
            .iter()
            .find(|(_, n)| *n >= rank)
            .map(|(le, _)| *le)
            .filter(|le| le.is_finite())
    }
}

fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, escaped)) = chars.next() {
                        value.push(if escaped == 'n' { '\n' } else { escaped });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(key.trim_start_matches(',').trim().to_owned(), value);
        rest = &after[end..];
    }
    out
}

/// GETs `url` (`http://host:port/path`) and parses it; the error says why not.
pub(crate) async fn scrape(url: &str) -> Result<Scrape, String> {
    let body = tokio::time::timeout(Duration::from_secs(10), get(url))
        .await
        .map_err(|_| format!("{url} did not answer within 10 s"))??;
    Ok(Scrape::parse(&body))
}

async fn get(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: only http:// metrics URLs are read"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/metrics"),
    };
    let mut stream = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{url}: not an HTTP response"))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(format!("{url} answered {status:?}"));
    }
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    Ok(if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    })
}

/// The body of a `Transfer-Encoding: chunked` response.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
        else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# HELP engram_consolidation_run_seconds time of one scheduled consolidation run
# TYPE engram_consolidation_run_seconds histogram
engram_consolidation_run_seconds_bucket{le="0.01"} 1
engram_consolidation_run_seconds_bucket{le="0.05"} 1
engram_consolidation_run_seconds_bucket{le="0.1"} 1
engram_consolidation_run_seconds_bucket{le="+Inf"} 1
engram_consolidation_run_seconds_sum 0.004
engram_consolidation_run_seconds_count 1
engram_projector_applied_total{projector="docs"} 10
engram_projector_applied_total{projector="facts"} 12
"#;

    const AFTER: &str = r#"engram_consolidation_run_seconds_bucket{le="0.01"} 3
engram_consolidation_run_seconds_bucket{le="0.05"} 5
engram_consolidation_run_seconds_bucket{le="0.1"} 6
engram_consolidation_run_seconds_bucket{le="+Inf"} 6
engram_consolidation_run_seconds_sum 0.2
engram_consolidation_run_seconds_count 6
engram_projector_applied_total{projector="docs"} 25
engram_projector_applied_total{projector="facts"} 30
engram_query_seconds_count{op="a \"quoted\" op"} 2
"#;

    #[test]
    fn a_model_is_the_sum_of_its_partition_instances() {
        let scrape = Scrape::parse(
            r#"engram_projector_batch_seconds_bucket{projector="docs-p0",le="0.1"} 2
engram_projector_batch_seconds_bucket{projector="docs-p0",le="+Inf"} 3
engram_projector_batch_seconds_bucket{projector="docs-p12",le="0.1"} 1
engram_projector_batch_seconds_bucket{projector="docs-p12",le="+Inf"} 1
engram_projector_batch_seconds_sum{projector="docs-p0"} 0.5
engram_projector_batch_seconds_sum{projector="docs-p12"} 0.25
engram_projector_batch_seconds_count{projector="docs-p0"} 3
engram_projector_batch_seconds_count{projector="docs-p12"} 1
engram_projector_batch_seconds_count{projector="docsx-p1"} 100
engram_projector_batch_seconds_count{projector="docs-p"} 100
engram_projector_batch_seconds_count{projector="docs-px"} 100
"#,
        );
        let docs = [("projector", "docs")];
        assert_eq!(
            scrape.sum("engram_projector_batch_seconds_count", &docs),
            Some(4.0)
        );
        assert_eq!(
            scrape.buckets("engram_projector_batch_seconds", &docs),
            vec![(0.1, 3.0), (f64::INFINITY, 4.0)]
        );
        // One instance alone, by its own name.
        assert_eq!(
            scrape.sum(
                "engram_projector_batch_seconds_count",
                &[("projector", "docs-p12")]
            ),
            Some(1.0)
        );
    }

    #[test]
    fn sums_and_histogram_differences_between_two_scrapes() {
        let (before, after) = (Scrape::parse(BEFORE), Scrape::parse(AFTER));
        assert_eq!(
            after.sum("engram_projector_applied_total", &[("projector", "docs")]),
            Some(25.0)
        );
        assert_eq!(after.sum("engram_projector_applied_total", &[]), Some(55.0));
        assert_eq!(after.sum("engram_missing", &[]), None);
        assert_eq!(
            after.sum("engram_query_seconds_count", &[("op", "a \"quoted\" op")]),
            Some(2.0)
        );
        let runs =
            HistogramDelta::between(&before, &after, "engram_consolidation_run_seconds", &[])
                .unwrap();
        assert_eq!(runs.count, 5.0);
        assert!((runs.sum - 0.196).abs() < 1e-9);
        // Of the five new runs, two took at most 10 ms, two more at most 50 ms, one at most
        // 100 ms.
        assert_eq!(runs.quantile_bound(0.4), Some(0.01));
        assert_eq!(runs.quantile_bound(0.5), Some(0.05));
        assert_eq!(runs.quantile_bound(1.0), Some(0.1));
        assert_eq!(HistogramDelta::default().quantile_bound(0.5), None);
    }

    #[test]
    fn a_chunked_body_is_joined() {
        assert_eq!(
            dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
            "hello world"
        );
    }
}
