//! Ranking: fuse the dense and keyword lists, then boost by recency and importance.
//!
//! Pure functions of their inputs (the clock is a parameter), so ranking is testable and a
//! benchmark measures exactly what the service does.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use engram_memory::proto::{Fusion, MemoryHit, MemoryResult, Ranking, ScoreParts};
use engram_memory::{Hit, Seq};

use crate::when::Mentions;

/// One retriever's answer: its ranked hits plus scores of extra candidates it was asked about.
#[derive(Clone, Debug, Default)]
pub struct Side {
    pub hits: Vec<MemoryHit>,
    pub also: Vec<Hit>,
}

#[derive(Default)]
struct Candidate {
    hit: Option<MemoryHit>,
    dense: Option<f32>,
    dense_rank: Option<usize>,
    keyword: Option<f32>,
    keyword_rank: Option<usize>,
}

/// What a retrieval returns: the best memories, and apart from them the best summaries.
#[derive(Debug, Default)]
pub struct Fused {
    pub results: Vec<MemoryResult>,
    pub summaries: Vec<MemoryResult>,
}

/// Ranks the union of both sides and returns the best `top_k`, with the best
/// `ranking.summaries` session summaries apart from them unless `summaries_compete`.
pub fn fuse(
    dense: &Side,
    keyword: &Side,
    ranking: &Ranking,
    now: DateTime<Utc>,
    top_k: usize,
) -> Fused {
    fuse_with(
        dense,
        keyword,
        ranking,
        &Mentions::default(),
        now,
        top_k,
        ranking.summary_results,
    )
}

/// [`fuse`], with the dates the query names (`dates`, from [`Mentions::parse`]) and
/// whether summaries compete for the `top_k` places decided by the caller (a filter that
/// asks for summaries makes them results).
pub fn fuse_with(
    dense: &Side,
    keyword: &Side,
    ranking: &Ranking,
    dates: &Mentions,
    now: DateTime<Utc>,
    top_k: usize,
    summaries_compete: bool,
) -> Fused {
    let mut candidates: HashMap<Seq, Candidate> = HashMap::new();
    for (rank, h) in dense.hits.iter().enumerate() {
        let c = candidates.entry(h.hit.seq).or_default();
        c.dense = Some(h.hit.score);
        c.dense_rank = Some(rank + 1);
        c.hit.get_or_insert_with(|| h.clone());
    }
    for (rank, h) in keyword.hits.iter().enumerate() {
        let c = candidates.entry(h.hit.seq).or_default();
        c.keyword = Some(h.hit.score);
        c.keyword_rank = Some(rank + 1);
        c.hit.get_or_insert_with(|| h.clone());
    }
    for also in &dense.also {
        if let Some(c) = candidates.get_mut(&also.seq) {
            c.dense.get_or_insert(also.score);
        }
    }
    for also in &keyword.also {
        if let Some(c) = candidates.get_mut(&also.seq) {
            c.keyword.get_or_insert(also.score);
        }
    }

    let w_kw = ranking.keyword_weight.clamp(0.0, 1.0);
    let w_dense = 1.0 - w_kw;
    // Normalisation ranges over the candidates: dense by min-max (cosines of unrelated text
    // are not 0), keyword by its maximum (BM25 of a non-matching memory is 0).
    let (d_min, d_max) = candidates
        .values()
        .filter_map(|c| c.dense)
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), d| {
            (lo.min(d), hi.max(d))
        });
    let k_max = candidates
        .values()
        .filter_map(|c| c.keyword)
        .fold(0.0f32, f32::max);

    let mut results: Vec<MemoryResult> = candidates
        .into_values()
        .filter_map(|c| {
            let hit = c.hit?;
            let fused = match ranking.fusion {
                Fusion::Rrf => {
                    let part = |rank: Option<usize>, w: f32| {
                        rank.map_or(0.0, |r| w / (ranking.rrf_k + r as f32))
                    };
                    part(c.dense_rank, w_dense) + part(c.keyword_rank, w_kw)
                }
                Fusion::Score => {
                    let d = match c.dense {
                        Some(d) if d_max > d_min => (d - d_min) / (d_max - d_min),
                        Some(_) => 1.0,
                        None => 0.0,
                    };
                    let k = match c.keyword {
                        Some(k) if k_max > 0.0 => k / k_max,
                        _ => 0.0,
                    };
                    w_dense * d + w_kw * k
                }
            };
            let recency_boost = if ranking.recency_half_life_hours > 0.0 {
                let age_h = (now - hit.meta.occurred_at).num_seconds().max(0) as f64 / 3600.0;
                ranking.recency_weight * 0.5f64.powf(age_h / ranking.recency_half_life_hours) as f32
            } else {
                0.0
            };
            let importance_boost = ranking.importance_weight * (hit.meta.importance as f32 - 0.5);
            let date_boost = ranking.date_weight
                * dates.nearness(hit.meta.occurred_at, ranking.date_half_life_days);
            let score =
                fused * (1.0 + recency_boost) * (1.0 + importance_boost) * (1.0 + date_boost);
            Some(MemoryResult {
                seq: hit.meta.seq,
                event_id: hit.meta.event_id.clone(),
                tenant: hit.meta.scope.tenant.clone(),
                scope: hit.meta.scope.scope(),
                agent_id: hit.meta.agent_id.clone(),
                layer: hit.meta.layer,
                kind: hit.meta.kind,
                occurred_at: hit.meta.occurred_at,
                importance: hit.meta.importance,
                tags: hit.meta.tags.clone(),
                confidence: hit.meta.confidence,
                text: hit.text,
                score,
                parts: ScoreParts {
                    dense: c.dense,
                    dense_rank: c.dense_rank,
                    keyword: c.keyword,
                    keyword_rank: c.keyword_rank,
                    fused,
                    recency_boost,
                    importance_boost,
                    date_boost,
                },
            })
        })
        .collect();
    results.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.seq.cmp(&b.seq)));
    if summaries_compete {
        return Fused {
            results: collapse(results, top_k),
            summaries: Vec::new(),
        };
    }
    let (summaries, results): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| {
        r.kind == engram_schema::EventKind::Consolidated
            && r.tags.iter().any(|t| t == engram_memory::SUMMARY_TAG)
    });
    Fused {
        results: collapse(results, top_k),
        summaries: collapse(summaries, ranking.summaries),
    }
}

/// The best `top_k` of `ranked` (best first) that each tell the reader something new: a
/// memory whose text is already wholly inside a better-ranked result's (a turn an
/// extractive session summary quotes, a copy another instance wrote before consolidation
/// merged them) is left out, and the next candidate takes its place. Every place of a
/// context window is spent on new text. Compared case-insensitively, whitespace collapsed.
pub fn collapse(ranked: Vec<MemoryResult>, top_k: usize) -> Vec<MemoryResult> {
    let mut kept: Vec<MemoryResult> = Vec::with_capacity(top_k.min(ranked.len()));
    let mut texts: Vec<String> = Vec::with_capacity(kept.capacity());
    for result in ranked {
        if kept.len() == top_k {
            break;
        }
        let text = normalised(&result.text);
        // Only a longer (or equal) text can hold this one; the checks are at most top_k
        // per candidate, over texts the read models already bound.
        let held = !text.is_empty()
            && texts
                .iter()
                .any(|t| t.len() >= text.len() && t.contains(text.as_str()));
        if held {
            continue;
        }
        texts.push(text);
        kept.push(result);
    }
    kept
}

fn normalised(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.extend(word.chars().flat_map(char::to_lowercase));
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use engram_memory::{MemoryMeta, ScopeKey};
    use engram_schema::{EventId, EventKind, Ident, Layer};

    use super::*;

    pub(crate) fn hit(seq: Seq, score: f32, importance: f64) -> MemoryHit {
        MemoryHit {
            hit: Hit { seq, score },
            meta: MemoryMeta {
                seq,
                event_id: EventId::new(),
                scope: ScopeKey {
                    tenant: Ident::parse("t", "acme").unwrap(),
                    kind: engram_schema::ScopeKind::Task,
                    id: Ident::parse("s", "t1").unwrap(),
                },
                agent_id: Ident::parse("a", "a1").unwrap(),
                layer: Layer::Episodic,
                kind: EventKind::Observation,
                occurred_at: Utc::now(),
                importance,
                tags: vec![],
                instance_id: None,
                confidence: 1.0,
            },
            text: format!("memory {seq}"),
        }
    }

    fn side(hits: &[(Seq, f32)]) -> Side {
        Side {
            hits: hits.iter().map(|&(s, x)| hit(s, x, 0.5)).collect(),
            also: vec![],
        }
    }

    #[test]
    fn a_memory_both_sides_like_beats_one_side_likes() {
        let dense = side(&[(1, 0.9), (2, 0.8), (3, 0.2)]);
        let keyword = side(&[(4, 10.0), (2, 9.0), (5, 1.0)]);
        for fusion in [Fusion::Rrf, Fusion::Score] {
            let ranking = Ranking {
                fusion,
                importance_weight: 0.0,
                ..Ranking::default()
            };
            let out = fuse(&dense, &keyword, &ranking, Utc::now(), 3).results;
            assert_eq!(out[0].seq, 2, "{fusion:?}: {out:?}");
            assert_eq!(out.len(), 3);
            assert_eq!(out[0].parts.dense_rank, Some(2));
            assert_eq!(out[0].parts.keyword_rank, Some(2));
        }
    }

    #[test]
    fn weights_move_the_balance() {
        let dense = side(&[(1, 0.9), (2, 0.1)]);
        let keyword = side(&[(2, 10.0), (1, 1.0)]);
        let only_kw = Ranking {
            keyword_weight: 1.0,
            importance_weight: 0.0,
            ..Ranking::default()
        };
        let only_dense = Ranking {
            keyword_weight: 0.0,
            ..only_kw.clone()
        };
        assert_eq!(
            fuse(&dense, &keyword, &only_kw, Utc::now(), 1).results[0].seq,
            2
        );
        assert_eq!(
            fuse(&dense, &keyword, &only_dense, Utc::now(), 1).results[0].seq,
            1
        );
    }

    #[test]
    fn importance_and_recency_boost_ties() {
        let mut dense = side(&[(1, 0.5), (2, 0.5)]);
        dense.hits[1].meta.importance = 1.0;
        let ranking = Ranking {
            importance_weight: 0.5,
            ..Ranking::default()
        };
        let out = fuse(&dense, &Side::default(), &ranking, Utc::now(), 2).results;
        assert_eq!(out[0].seq, 2);
        assert!(out[0].parts.importance_boost > 0.0);

        let mut dense = side(&[(1, 0.5), (2, 0.5)]);
        dense.hits[0].meta.occurred_at = Utc::now() - chrono::Duration::days(30);
        let ranking = Ranking {
            importance_weight: 0.0,
            recency_half_life_hours: 24.0,
            recency_weight: 1.0,
            ..Ranking::default()
        };
        let out = fuse(&dense, &Side::default(), &ranking, Utc::now(), 2).results;
        assert_eq!(out[0].seq, 2, "the older memory decayed");
    }

    #[test]
    fn a_date_the_query_names_lifts_the_memories_from_then() {
        let at = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
        // Seq 1 is the better text match; seq 2 happened on the day the query names.
        let mut dense = side(&[(1, 0.9), (2, 0.7), (3, 0.1)]);
        dense.hits[0].meta.occurred_at = at("2023-05-08T13:56:00Z");
        dense.hits[1].meta.occurred_at = at("2023-10-13T10:31:00Z");
        dense.hits[2].meta.occurred_at = at("2023-10-13T10:32:00Z");
        let now = at("2026-12-07T00:00:00Z");
        let dates = Mentions::parse("which painting was shown on October 13, 2023?", now);
        let ranking = Ranking {
            importance_weight: 0.0,
            ..Ranking::default()
        };
        let ranked = |ranking: &Ranking, dates: &Mentions| -> Vec<Seq> {
            fuse_with(&dense, &Side::default(), ranking, dates, now, 3, false)
                .results
                .iter()
                .map(|r| r.seq)
                .collect()
        };
        assert_eq!(ranked(&ranking, &dates), vec![2, 1, 3]);
        // Nearness lifts; it does not replace relevance: seq 3 (a poor match from the same
        // day, fused 0) stays last.
        let out = fuse_with(&dense, &Side::default(), &ranking, &dates, now, 3, false).results;
        assert_eq!(out[0].parts.date_boost, 1.0);
        assert!(out[1].parts.date_boost < 1e-3);
        // Without a named date, or with the weight at 0, relevance alone decides.
        assert_eq!(ranked(&ranking, &Mentions::default()), vec![1, 2, 3]);
        let off = Ranking {
            date_weight: 0.0,
            ..ranking.clone()
        };
        assert_eq!(ranked(&off, &dates), vec![1, 2, 3]);
    }

    /// Score fusion compares both retrievers on every candidate: a memory only one list
    /// ranked gets the other side's score from that side's `also`, which is what lets a
    /// memory both sides like, but one ranked too low to list, win.
    #[test]
    fn score_fusion_takes_the_other_sides_score_of_a_candidate_from_also() {
        // Memory 2 is dense's best and keyword's third: too deep for keyword's list of two
        let dense = side(&[(2, 0.9), (1, 0.5), (3, 0.1)]);
        let mut keyword = side(&[(1, 10.0), (3, 9.0)]);
        let ranking = Ranking {
            fusion: Fusion::Score,
            keyword_weight: 0.5,
            importance_weight: 0.0,
            ..Ranking::default()
        };
        // Without its keyword score, 1 wins on keyword alone
        let blind = fuse(&dense, &keyword, &ranking, Utc::now(), 3).results;
        assert_eq!(blind[0].seq, 1, "{blind:?}");
        let two = blind.iter().find(|r| r.seq == 2).unwrap();
        assert_eq!(two.parts.keyword, None);

        // With it (and keyword's score of 8.5 is nearly its best), 2 wins
        keyword.also = vec![Hit { seq: 2, score: 8.5 }];
        let out = fuse(&dense, &keyword, &ranking, Utc::now(), 3).results;
        assert_eq!(out[0].seq, 2, "{out:?}");
        assert_eq!(out[0].parts.keyword, Some(8.5));
        // Taken as a score, not a rank: the memory was not in keyword's list
        assert_eq!(out[0].parts.keyword_rank, None);
        assert_eq!(out[0].parts.dense_rank, Some(1));
    }

    /// A memory wholly quoted by a better-ranked one (a summary's sentence, a copy) gives its
    /// place to the next candidate; one that holds more than a better-ranked one stays.
    #[test]
    fn a_result_already_inside_a_better_one_gives_its_place_to_the_next() {
        let mut dense = side(&[(1, 0.9), (2, 0.8), (3, 0.7), (4, 0.6)]);
        dense.hits[0].text = "Caroline went to a LGBTQ support group. It was powerful.".into();
        dense.hits[1].text = "it was   POWERFUL.".into();
        dense.hits[2].text =
            "Caroline went to a LGBTQ support group. It was powerful. Then she left.".into();
        let ranking = Ranking {
            fusion: Fusion::Score,
            importance_weight: 0.0,
            ..Ranking::default()
        };
        let out = fuse(&dense, &Side::default(), &ranking, Utc::now(), 3).results;
        let seqs: Vec<Seq> = out.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [1, 3, 4], "2 is inside 1; 3 holds 1 and more");
        // Two places: the duplicate never takes one
        let out = fuse(&dense, &Side::default(), &ranking, Utc::now(), 2).results;
        assert_eq!(out.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 3]);
    }

    /// `also` scores candidates the lists brought; it never adds a memory of its own, nor
    /// replaces the score of one its side ranked.
    #[test]
    fn also_neither_adds_candidates_nor_overrides_a_ranked_score() {
        let mut dense = side(&[(1, 0.9)]);
        dense.also = vec![Hit { seq: 1, score: 0.1 }, Hit { seq: 9, score: 1.0 }];
        let mut keyword = side(&[(2, 5.0)]);
        keyword.also = vec![Hit { seq: 1, score: 4.0 }, Hit { seq: 8, score: 9.0 }];
        let ranking = Ranking {
            fusion: Fusion::Score,
            importance_weight: 0.0,
            ..Ranking::default()
        };
        let out = fuse(&dense, &keyword, &ranking, Utc::now(), 10).results;
        let seqs: std::collections::BTreeSet<Seq> = out.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [1, 2].into());
        let one = out.iter().find(|r| r.seq == 1).unwrap();
        assert_eq!(one.parts.dense, Some(0.9), "the ranked score stands");
        assert_eq!(
            one.parts.keyword,
            Some(4.0),
            "the missing side comes from also"
        );
    }
}
