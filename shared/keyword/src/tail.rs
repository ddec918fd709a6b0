//! The tail segment: documents added since the last commit, searched beside it.
//!
//! A tantivy commit is an fsync and a new segment, so the projector spaces commits out; until
//! one lands, what it added is invisible to tantivy's searcher. The tail keeps those documents
//! in memory as a small inverted index (the analysed terms of each, with their frequencies),
//! and a search scores them with the same BM25 as the committed documents, over statistics
//! that count both ([`crate::stats::ScopedStats`]). A fresh write is therefore found as soon as it is added,
//! at the score the commit will give it, and the commit only makes it durable. A commit
//! empties the tail under the same lock a search takes its searcher under, so no search sees
//! a document twice or not at all.
//!
//! Nothing here is durable: after a crash the tail is gone with the uncommitted documents, and
//! the projector replays them from the stream after the last commit.

use std::collections::{BTreeMap, HashMap};

use engram_memory::{Hit, MemoryFilter, MemoryMeta, ScopeKey, Seq};
use tantivy::Term;
use tantivy::fieldnorm::FieldNormReader;
use tantivy::query::{Bm25StatisticsProvider, Bm25Weight};
use tantivy::tokenizer::{TextAnalyzer, TokenStream};

/// One document of the tail.
struct TailDoc {
    meta: MemoryMeta,
    /// Each distinct term of its text, with how often it occurs.
    terms: Vec<(String, u32)>,
    /// Tokens in its text: what tantivy stores as its field norm.
    tokens: u32,
}

/// Documents added since the last commit, by sequence.
#[derive(Default)]
pub(crate) struct TailSegment {
    docs: BTreeMap<Seq, TailDoc>,
    /// Term to the documents holding it and the term's frequency in each.
    postings: HashMap<String, BTreeMap<Seq, u32>>,
}

impl TailSegment {
    pub(crate) fn len(&self) -> usize {
        self.docs.len()
    }

    /// The sequences it holds: a committed hit of one of them is superseded by the tail's.
    pub(crate) fn seqs(&self) -> std::collections::HashSet<Seq> {
        self.docs.keys().copied().collect()
    }

    /// Adds memory `meta.seq` (replacing the tail's copy, if any), with `text` analysed as the
    /// index analyses it.
    pub(crate) fn insert(&mut self, analyzer: &TextAnalyzer, meta: &MemoryMeta, text: &str) {
        self.remove(meta.seq);
        let mut analyzer = analyzer.clone();
        let mut stream = analyzer.token_stream(text);
        let mut counts: HashMap<String, u32> = HashMap::new();
        let mut tokens = 0u32;
        while stream.advance() {
            tokens = tokens.saturating_add(1);
            *counts.entry(stream.token().text.clone()).or_default() += 1;
        }
        let mut terms: Vec<(String, u32)> = counts.into_iter().collect();
        terms.sort_unstable();
        for (term, tf) in &terms {
            self.postings
                .entry(term.clone())
                .or_default()
                .insert(meta.seq, *tf);
        }
        self.docs.insert(
            meta.seq,
            TailDoc {
                meta: meta.clone(),
                terms,
                tokens,
            },
        );
    }

    /// Drops memory `seq` from the tail, if it is there.
    pub(crate) fn remove(&mut self, seq: Seq) {
        let Some(doc) = self.docs.remove(&seq) else {
            return;
        };
        for (term, _) in doc.terms {
            if let Some(docs) = self.postings.get_mut(&term) {
                docs.remove(&seq);
                if docs.is_empty() {
                    self.postings.remove(&term);
                }
            }
        }
    }

    /// Drops every document of `scope`.
    pub(crate) fn remove_scope(&mut self, scope: &ScopeKey) {
        let seqs: Vec<Seq> = self
            .docs
            .iter()
            .filter(|(_, d)| &d.meta.scope == scope)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in seqs {
            self.remove(seq);
        }
    }

    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }

    /// The tail's documents that match any of `terms` (analysed query terms), of `scopes` and
    /// passing `filter`: each with the terms it holds (by index into `terms`) and their
    /// frequencies. Taken under the tail's lock and scored after it ([`TailMatches::score`]).
    pub(crate) fn matches(
        &self,
        terms: &[Term],
        scopes: &[ScopeKey],
        filter: &MemoryFilter,
    ) -> TailMatches {
        let mut docs: BTreeMap<Seq, (u32, Vec<(usize, u32)>)> = BTreeMap::new();
        for (i, term) in terms.iter().enumerate() {
            let value = term.value();
            let Some(text) = value.as_str() else {
                continue;
            };
            let Some(holding) = self.postings.get(text) else {
                continue;
            };
            for (seq, tf) in holding {
                let doc = &self.docs[seq];
                if !scopes.contains(&doc.meta.scope) || !filter.matches(&doc.meta) {
                    continue;
                }
                docs.entry(*seq)
                    .or_insert_with(|| (doc.tokens, Vec::new()))
                    .1
                    .push((i, *tf));
            }
        }
        TailMatches(docs)
    }
}

/// What [`TailSegment::matches`] found: sequence to (tokens, the query terms it holds).
pub(crate) struct TailMatches(BTreeMap<Seq, (u32, Vec<(usize, u32)>)>);

impl TailMatches {
    /// Scores the matches by BM25 with the statistics `stats` gives: the sum over the terms
    /// a document holds, as tantivy's boolean query of the same terms sums them.
    pub(crate) fn score(
        self,
        stats: &dyn Bm25StatisticsProvider,
        terms: &[Term],
    ) -> tantivy::Result<Vec<Hit>> {
        let mut weights: Vec<Option<Bm25Weight>> = vec![None; terms.len()];
        let mut hits = Vec::with_capacity(self.0.len());
        for (seq, (tokens, held)) in self.0 {
            let norm = FieldNormReader::fieldnorm_to_id(tokens);
            let mut score = 0.0;
            for (i, tf) in held {
                let weight = match &weights[i] {
                    Some(w) => w,
                    None => weights[i].insert(Bm25Weight::for_terms(
                        stats,
                        std::slice::from_ref(&terms[i]),
                    )?),
                };
                score += weight.score(norm, tf);
            }
            hits.push(Hit { seq, score });
        }
        Ok(hits)
    }
}

/// What BM25 needs of the tail for one query, counting only the searched scopes' documents:
/// how many, their lengths as the index will store them, and how many hold each query term.
/// Taken under the tail's lock, so that the committed search can run after it is released.
pub(crate) struct TailStats {
    pub(crate) docs: u64,
    pub(crate) tokens: u64,
    doc_freqs: HashMap<String, u64>,
}

impl TailStats {
    /// How many of the searched scopes' tail documents hold `term` (of the text field).
    pub(crate) fn doc_freq(&self, term: &Term) -> u64 {
        let value = term.value();
        value
            .as_str()
            .and_then(|t| self.doc_freqs.get(t))
            .copied()
            .unwrap_or(0)
    }
}

impl TailSegment {
    pub(crate) fn stats(&self, terms: &[Term], scopes: &[ScopeKey]) -> TailStats {
        let mine = |seq: &Seq| {
            self.docs
                .get(seq)
                .is_some_and(|d| scopes.contains(&d.meta.scope))
        };
        let (docs, tokens) = self
            .docs
            .values()
            .filter(|d| scopes.contains(&d.meta.scope))
            .fold((0, 0), |(docs, tokens), d| {
                (docs + 1, tokens + crate::stats::stored_length(d.tokens))
            });
        TailStats {
            docs,
            tokens,
            doc_freqs: terms
                .iter()
                .filter_map(|t| {
                    let value = t.value();
                    let text = value.as_str()?;
                    let holding = self.postings.get(text)?.keys().filter(|s| mine(s)).count();
                    Some((text.to_owned(), holding as u64))
                })
                .collect(),
        }
    }
}
