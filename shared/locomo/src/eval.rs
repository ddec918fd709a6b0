//! Scoring: turn- and session-level recall@k and query latency, per retrieval mode and per
//! question category.
//!
//! Recall of one question is a share in [0, 1]; a group's figure is the mean over its
//! questions (so "overall" weighs every question alike, not every category). A ranked list
//! is cut at k as given: a retriever that repeats a turn spends a slot on it, and the report
//! counts how often that happened.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Serialize, Serializer};

use crate::dataset::{DatasetCounts, Question, category_name};
use crate::dia_id::DiaId;

/// The protocol's cut-offs.
pub const DEFAULT_KS: [usize; 3] = [5, 10, 20];

/// The scored categories, in report order.
const CATEGORIES: [u8; 4] = [1, 2, 3, 4];

/// Latencies above an hour are recorded as an hour: a query that slow is a failure anyway.
const MAX_LATENCY_MICROS: u64 = 3_600_000_000;

/// The k whose turn recall the report compares across modes.
const HEADLINE_K: usize = 10;

/// Share of the distinct `evidence` turns found among the first `k` of `ranked`; `None`
/// when there is no evidence, since recall is then undefined.
pub fn turn_recall(evidence: &[DiaId], ranked: &[DiaId], k: usize) -> Option<f64> {
    let wanted: HashSet<DiaId> = evidence.iter().copied().collect();
    let top: HashSet<DiaId> = ranked.iter().take(k).copied().collect();
    share(wanted.len(), wanted.intersection(&top).count())
}

/// Share of the distinct sessions of `evidence` that some turn among the first `k` of
/// `ranked` comes from; `None` when there is no evidence.
pub fn session_recall(evidence: &[DiaId], ranked: &[DiaId], k: usize) -> Option<f64> {
    let wanted: HashSet<u32> = evidence.iter().map(|id| id.session).collect();
    let top: HashSet<u32> = ranked.iter().take(k).map(|id| id.session).collect();
    share(wanted.len(), wanted.intersection(&top).count())
}

fn share(of: usize, found: usize) -> Option<f64> {
    (of > 0).then(|| found as f64 / of as f64)
}

/// Collects per-question results for any number of retrieval modes.
#[derive(Debug)]
pub struct Evaluator {
    ks: Vec<usize>,
    dataset: Option<DatasetCounts>,
    /// In the order each mode was first recorded, which is the order the report shows.
    modes: Vec<(String, ModeStats)>,
}

#[derive(Debug)]
struct ModeStats {
    overall: GroupStats,
    /// Indexed by category - 1.
    categories: [GroupStats; 4],
    ranked_with_duplicates: u64,
}

#[derive(Debug)]
struct GroupStats {
    questions: u64,
    /// Sums of per-question recall, one per k in the evaluator's order.
    turn_sums: Vec<f64>,
    session_sums: Vec<f64>,
    latency_micros: Histogram<u64>,
}

impl Default for Evaluator {
    fn default() -> Self {
        Self::new(&DEFAULT_KS)
    }
}

impl Evaluator {
    /// Scores recall at each of `ks` (sorted, deduplicated; k = 0 is allowed and scores 0).
    pub fn new(ks: &[usize]) -> Self {
        let mut ks = ks.to_vec();
        ks.sort_unstable();
        ks.dedup();
        Self {
            ks,
            dataset: None,
            modes: Vec::new(),
        }
    }

    /// Puts the dataset's counts in the report, so a reader sees what the figures cover.
    pub fn with_dataset(mut self, counts: DatasetCounts) -> Self {
        self.dataset = Some(counts);
        self
    }

    pub fn ks(&self) -> &[usize] {
        &self.ks
    }

    /// Records one question's ranked turns (best first; may be shorter than any k) and how
    /// long the query took, under `mode` (e.g. `hybrid`). Returns false, recording nothing,
    /// for a question that does not count toward recall ([`Question::is_asked`]).
    pub fn record(
        &mut self,
        mode: &str,
        question: &Question,
        ranked: &[DiaId],
        latency: Duration,
    ) -> bool {
        if !question.is_asked() {
            return false;
        }
        let Some(category_slot) = CATEGORIES.iter().position(|&c| c == question.category) else {
            return false;
        };
        let turn: Vec<f64> = self
            .ks
            .iter()
            .map(|&k| turn_recall(&question.evidence, ranked, k).unwrap_or(0.0))
            .collect();
        let session: Vec<f64> = self
            .ks
            .iter()
            .map(|&k| session_recall(&question.evidence, ranked, k).unwrap_or(0.0))
            .collect();
        let deepest = self.ks.last().copied().unwrap_or(0);
        let repeats = has_duplicates(&ranked[..ranked.len().min(deepest)]);
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);

        let n_ks = self.ks.len();
        let stats = self.mode_mut(mode, n_ks);
        stats.overall.add(&turn, &session, micros);
        stats.categories[category_slot].add(&turn, &session, micros);
        if repeats {
            stats.ranked_with_duplicates += 1;
        }
        true
    }

    fn mode_mut(&mut self, mode: &str, n_ks: usize) -> &mut ModeStats {
        let at = match self.modes.iter().position(|(name, _)| name == mode) {
            Some(at) => at,
            None => {
                self.modes.push((mode.to_owned(), ModeStats::new(n_ks)));
                self.modes.len() - 1
            }
        };
        &mut self.modes[at].1
    }

    pub fn report(&self) -> Report {
        let modes = self
            .modes
            .iter()
            .map(|(mode, stats)| ModeReport {
                mode: mode.clone(),
                overall: stats.overall.report(&self.ks),
                by_category: CATEGORIES
                    .iter()
                    .zip(&stats.categories)
                    .filter(|(_, group)| group.questions > 0)
                    .map(|(&category, group)| CategoryReport {
                        category,
                        name: category_name(category).unwrap_or("unknown"),
                        scores: group.report(&self.ks),
                    })
                    .collect(),
                ranked_with_duplicates: stats.ranked_with_duplicates,
            })
            .collect();
        Report {
            ks: self.ks.clone(),
            dataset: self.dataset,
            modes,
        }
    }
}

fn has_duplicates(ids: &[DiaId]) -> bool {
    let mut seen = HashSet::with_capacity(ids.len());
    !ids.iter().all(|id| seen.insert(*id))
}

impl ModeStats {
    fn new(n_ks: usize) -> Self {
        Self {
            overall: GroupStats::new(n_ks),
            categories: std::array::from_fn(|_| GroupStats::new(n_ks)),
            ranked_with_duplicates: 0,
        }
    }
}

impl GroupStats {
    fn new(n_ks: usize) -> Self {
        Self {
            questions: 0,
            turn_sums: vec![0.0; n_ks],
            session_sums: vec![0.0; n_ks],
            latency_micros: Histogram::new_with_bounds(1, MAX_LATENCY_MICROS, 3)
                .expect("constant histogram bounds are valid"),
        }
    }

    fn add(&mut self, turn: &[f64], session: &[f64], micros: u64) {
        self.questions += 1;
        for (sum, r) in self.turn_sums.iter_mut().zip(turn) {
            *sum += r;
        }
        for (sum, r) in self.session_sums.iter_mut().zip(session) {
            *sum += r;
        }
        self.latency_micros.saturating_record(micros);
    }

    fn report(&self, ks: &[usize]) -> GroupReport {
        let n = self.questions.max(1) as f64;
        let means = |sums: &[f64]| ks.iter().zip(sums).map(|(&k, s)| (k, s / n)).collect();
        let ms = |q: f64| self.latency_micros.value_at_quantile(q) as f64 / 1000.0;
        GroupReport {
            questions: self.questions,
            turn_recall: means(&self.turn_sums),
            session_recall: means(&self.session_sums),
            latency_ms: LatencyMs {
                p50: ms(0.5),
                p99: ms(0.99),
            },
        }
    }
}

/// Every mode's figures. `Serialize` gives the `--json` form; `Display` a fixed-width table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub ks: Vec<usize>,
    pub dataset: Option<DatasetCounts>,
    /// In the order the modes were first recorded; serialised as a map keyed by mode.
    #[serde(serialize_with = "as_map")]
    pub modes: Vec<ModeReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModeReport {
    #[serde(skip)]
    pub mode: String,
    pub overall: GroupReport,
    /// Only categories with at least one question, in category order; serialised as a map
    /// keyed by category name.
    #[serde(serialize_with = "as_map")]
    pub by_category: Vec<CategoryReport>,
    /// Questions whose ranked list named a turn twice within the deepest k.
    pub ranked_with_duplicates: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CategoryReport {
    pub category: u8,
    #[serde(skip)]
    pub name: &'static str,
    #[serde(flatten)]
    pub scores: GroupReport,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GroupReport {
    pub questions: u64,
    /// Mean turn-level recall, by k.
    pub turn_recall: BTreeMap<usize, f64>,
    /// Mean session-level recall, by k.
    pub session_recall: BTreeMap<usize, f64>,
    pub latency_ms: LatencyMs,
}

/// Query latency percentiles, in milliseconds at microsecond precision.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LatencyMs {
    pub p50: f64,
    pub p99: f64,
}

trait Keyed {
    fn key(&self) -> &str;
}

impl Keyed for ModeReport {
    fn key(&self) -> &str {
        &self.mode
    }
}

impl Keyed for CategoryReport {
    fn key(&self) -> &str {
        self.name
    }
}

fn as_map<T: Keyed + Serialize, S: Serializer>(
    items: &[T],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(items.iter().map(|item| (item.key(), item)))
}

impl Report {
    pub fn mode(&self, mode: &str) -> Option<&ModeReport> {
        self.modes.iter().find(|m| m.mode == mode)
    }

    /// The k the closing comparison uses: 10 when scored, else the deepest.
    fn headline_k(&self) -> Option<usize> {
        if self.ks.contains(&HEADLINE_K) {
            Some(HEADLINE_K)
        } else {
            self.ks.last().copied()
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(d) = &self.dataset {
            writeln!(
                f,
                "locomo: {} conversations, {} sessions, {} turns; {} questions asked, {} skipped \
                 for no evidence, {} adversarial not asked; {} evidence ids match no turn",
                d.conversations,
                d.sessions,
                d.turns,
                d.questions_asked,
                d.questions_skipped_no_evidence,
                d.questions_adversarial,
                d.unmatched_evidence,
            )?;
        }
        let mode_width = self
            .modes
            .iter()
            .map(|m| m.mode.len())
            .max()
            .unwrap_or(0)
            .max(4);
        write!(f, "{:<mode_width$}  {:<11} {:>5} ", "mode", "category", "n")?;
        for k in &self.ks {
            write!(f, " {:>7}", format!("turn@{k}"))?;
        }
        write!(f, " ")?;
        for k in &self.ks {
            write!(f, " {:>7}", format!("sess@{k}"))?;
        }
        writeln!(f, "  {:>8} {:>8}", "p50 ms", "p99 ms")?;

        for mode in &self.modes {
            let rows = mode
                .by_category
                .iter()
                .map(|c| (c.name, &c.scores))
                .chain([("overall", &mode.overall)]);
            for (name, scores) in rows {
                write!(
                    f,
                    "{:<mode_width$}  {:<11} {:>5} ",
                    mode.mode, name, scores.questions
                )?;
                for r in scores.turn_recall.values() {
                    write!(f, " {r:>7.3}")?;
                }
                write!(f, " ")?;
                for r in scores.session_recall.values() {
                    write!(f, " {r:>7.3}")?;
                }
                writeln!(
                    f,
                    "  {:>8.2} {:>8.2}",
                    scores.latency_ms.p50, scores.latency_ms.p99
                )?;
            }
        }

        if let Some(k) = self.headline_k() {
            let headline = |m: &ModeReport| m.overall.turn_recall.get(&k).copied().unwrap_or(0.0);
            for mode in &self.modes {
                let own = headline(mode);
                write!(f, "{:<mode_width$}  turn R@{k} {own:.3}", mode.mode)?;
                for other in self.modes.iter().filter(|o| o.mode != mode.mode) {
                    write!(f, "  {:+.3} vs {}", own - headline(other), other.mode)?;
                }
                writeln!(f)?;
            }
        }

        for mode in &self.modes {
            if let Some(d) = &self.dataset
                && mode.overall.questions != d.questions_asked as u64
            {
                writeln!(
                    f,
                    "note: {} scored {} of the {} questions asked",
                    mode.mode, mode.overall.questions, d.questions_asked
                )?;
            }
            if mode.ranked_with_duplicates > 0 {
                writeln!(
                    f,
                    "note: {} returned a turn twice for {} questions",
                    mode.mode, mode.ranked_with_duplicates
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(session: u32, turn: u32) -> DiaId {
        DiaId::new(session, turn)
    }

    fn question(category: u8, evidence: Vec<DiaId>) -> Question {
        Question {
            question: "q".into(),
            answer: Some("a".into()),
            evidence,
            category,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn turn_recall_counts_evidence_in_the_top_k() {
        let evidence = [d(1, 1), d(2, 3)];
        let ranked = [d(1, 1), d(5, 5), d(2, 3)];
        assert_eq!(turn_recall(&evidence, &ranked, 1), Some(0.5));
        assert_eq!(turn_recall(&evidence, &ranked, 2), Some(0.5));
        assert_eq!(turn_recall(&evidence, &ranked, 3), Some(1.0));
        assert_eq!(turn_recall(&evidence, &ranked, 0), Some(0.0));
        assert_eq!(turn_recall(&evidence, &[], 10), Some(0.0));
    }

    #[test]
    fn fewer_results_than_k_is_fine() {
        let evidence = [d(1, 1), d(1, 2)];
        assert_eq!(turn_recall(&evidence, &[d(1, 2)], 20), Some(0.5));
        assert_eq!(session_recall(&evidence, &[d(1, 9)], 20), Some(1.0));
    }

    #[test]
    fn a_repeated_turn_spends_a_slot_and_counts_once() {
        let evidence = [d(1, 1), d(1, 2)];
        let ranked = [d(1, 1), d(1, 1), d(1, 2)];
        assert_eq!(turn_recall(&evidence, &ranked, 2), Some(0.5));
        assert_eq!(turn_recall(&evidence, &ranked, 3), Some(1.0));
        assert_eq!(
            turn_recall(&evidence, &[d(1, 1), d(1, 1), d(1, 1)], 3),
            Some(0.5)
        );
        assert_eq!(
            turn_recall(&[d(1, 1), d(1, 1)], &[d(1, 1)], 1),
            Some(1.0),
            "repeated evidence is one turn"
        );
    }

    #[test]
    fn session_recall_counts_distinct_evidence_sessions() {
        let evidence = [d(1, 1), d(1, 2), d(3, 4)];
        // Other turns of the right sessions: no turn hit, every session hit.
        assert_eq!(turn_recall(&evidence, &[d(1, 5), d(3, 1)], 2), Some(0.0));
        assert_eq!(session_recall(&evidence, &[d(1, 5), d(3, 1)], 2), Some(1.0));
        // One of three turns, but one of two sessions.
        let r = turn_recall(&evidence, &[d(1, 1)], 5).unwrap();
        assert!(close(r, 1.0 / 3.0));
        assert_eq!(session_recall(&evidence, &[d(1, 1)], 5), Some(0.5));
        // The session beyond k does not count.
        assert_eq!(
            session_recall(&evidence, &[d(1, 1), d(2, 1), d(3, 4)], 2),
            Some(0.5)
        );
    }

    #[test]
    fn recall_without_evidence_is_undefined() {
        assert_eq!(turn_recall(&[], &[d(1, 1)], 5), None);
        assert_eq!(session_recall(&[], &[d(1, 1)], 5), None);
    }

    #[test]
    fn groups_average_over_questions() {
        let mut eval = Evaluator::new(&[10, 1, 10]);
        assert_eq!(eval.ks(), [1, 10]);
        let ms = Duration::from_millis;
        // multi-hop: recall@1 = 1.0 and 0.0; temporal: 0.5.
        assert!(eval.record("bm25", &question(1, vec![d(1, 1)]), &[d(1, 1)], ms(1)));
        assert!(eval.record(
            "bm25",
            &question(1, vec![d(2, 1)]),
            &[d(1, 1), d(2, 1)],
            ms(2)
        ));
        assert!(eval.record(
            "bm25",
            &question(2, vec![d(1, 1), d(2, 2)]),
            &[d(2, 2)],
            ms(3)
        ));
        // Not asked: adversarial, and scored but without evidence.
        assert!(!eval.record("bm25", &question(5, vec![d(1, 1)]), &[d(1, 1)], ms(1)));
        assert!(!eval.record("dense", &question(3, vec![]), &[d(1, 1)], ms(1)));

        let report = eval.report();
        assert_eq!(
            report.modes.len(),
            1,
            "a mode with nothing scored is not reported"
        );
        let bm25 = report.mode("bm25").unwrap();
        assert_eq!(bm25.overall.questions, 3);
        assert!(close(bm25.overall.turn_recall[&1], 1.5 / 3.0));
        assert!(close(bm25.overall.turn_recall[&10], 2.5 / 3.0));
        assert!(close(bm25.overall.session_recall[&1], 1.5 / 3.0));
        let cats: Vec<(u8, &str, u64)> = bm25
            .by_category
            .iter()
            .map(|c| (c.category, c.name, c.scores.questions))
            .collect();
        assert_eq!(cats, [(1, "multi-hop", 2), (2, "temporal", 1)]);
        assert!(close(bm25.by_category[0].scores.turn_recall[&1], 0.5));
        assert!(close(bm25.by_category[1].scores.turn_recall[&10], 0.5));
        assert_eq!(bm25.ranked_with_duplicates, 0);
    }

    #[test]
    fn latency_percentiles_are_in_milliseconds() {
        let mut eval = Evaluator::default();
        let q = question(4, vec![d(1, 1)]);
        for ms in 1..=100 {
            eval.record("dense", &q, &[], Duration::from_millis(ms));
        }
        let latency = eval.report().mode("dense").unwrap().overall.latency_ms;
        // hdrhistogram keeps 3 significant digits.
        assert!((latency.p50 - 50.0).abs() < 0.1, "{latency:?}");
        assert!((latency.p99 - 99.0).abs() < 0.1, "{latency:?}");
    }

    #[test]
    fn repeated_turns_are_counted_per_mode() {
        let mut eval = Evaluator::default();
        let q = question(4, vec![d(1, 1)]);
        eval.record("hybrid", &q, &[d(1, 2), d(1, 2)], Duration::ZERO);
        eval.record("hybrid", &q, &[d(1, 1), d(1, 2)], Duration::ZERO);
        // Beyond the deepest k (20) a repeat cannot cost anything.
        let mut long: Vec<DiaId> = (1..=20).map(|t| d(2, t)).collect();
        long.push(d(2, 1));
        eval.record("hybrid", &q, &long, Duration::ZERO);
        assert_eq!(
            eval.report().mode("hybrid").unwrap().ranked_with_duplicates,
            1
        );
    }

    fn three_modes() -> Report {
        let counts = DatasetCounts {
            conversations: 1,
            sessions: 2,
            turns: 9,
            questions: 3,
            questions_asked: 2,
            questions_skipped_no_evidence: 1,
            questions_adversarial: 0,
            unmatched_evidence: 0,
        };
        let mut eval = Evaluator::default().with_dataset(counts);
        let q1 = question(1, vec![d(1, 1)]);
        let q4 = question(4, vec![d(1, 2), d(2, 1)]);
        let ms = Duration::from_millis(2);
        eval.record("hybrid", &q1, &[d(1, 1)], ms);
        eval.record("hybrid", &q4, &[d(1, 2), d(2, 1)], ms);
        eval.record("dense", &q1, &[d(2, 2)], ms);
        eval.record("dense", &q4, &[d(1, 2)], ms);
        eval.record("bm25", &q1, &[d(1, 1)], ms);
        eval.report()
    }

    #[test]
    fn json_is_keyed_by_mode_category_and_k() {
        let json = serde_json::to_value(three_modes()).unwrap();
        let hybrid = &json["modes"]["hybrid"];
        assert_eq!(hybrid["overall"]["questions"], 2);
        assert_eq!(hybrid["overall"]["turn_recall"]["10"], 1.0);
        assert_eq!(json["modes"]["dense"]["overall"]["turn_recall"]["10"], 0.25);
        assert_eq!(
            json["modes"]["dense"]["overall"]["session_recall"]["5"],
            0.25
        );
        assert_eq!(hybrid["by_category"]["single-hop"]["category"], 4);
        assert_eq!(hybrid["by_category"]["multi-hop"]["questions"], 1);
        assert!(hybrid["overall"]["latency_ms"]["p99"].as_f64().unwrap() > 1.9);
        assert_eq!(json["dataset"]["questions_asked"], 2);
        assert_eq!(json["ks"], serde_json::json!([5, 10, 20]));
    }

    #[test]
    fn table_has_a_row_per_mode_and_category_and_compares_modes() {
        let text = three_modes().to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].contains("2 questions asked"), "{text}");
        assert!(
            lines[1].contains("turn@10") && lines[1].contains("sess@20"),
            "{text}"
        );
        // hybrid and dense: two categories + overall; bm25: one category + overall.
        let rows = |mode: &str| {
            lines
                .iter()
                .filter(|l| l.starts_with(&format!("{mode} ")))
                .count()
        };
        assert_eq!(rows("hybrid"), 4, "{text}");
        assert_eq!(rows("dense"), 4, "{text}");
        assert_eq!(rows("bm25"), 3, "{text}");
        let compare = lines
            .iter()
            .find(|l| l.starts_with("dense") && l.contains("turn R@10"))
            .unwrap();
        assert!(compare.contains("turn R@10 0.250"), "{compare}");
        assert!(compare.contains("-0.750 vs hybrid"), "{compare}");
        assert!(compare.contains("-0.750 vs bm25"), "{compare}");
        assert!(
            text.contains("note: bm25 scored 1 of the 2 questions asked"),
            "{text}"
        );
        assert!(!text.contains("note: hybrid"), "{text}");
    }
}
