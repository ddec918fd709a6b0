//! The tail segment: documents added since the last commit, searched beside it.
//!
//! A tantivy commit is an fsync and a new segment, so the projector spaces commits out; until
//! one lands, what it added is invisible to tantivy's searcher. The tail keeps those documents
//! in memory as a small inverted index (the analysed terms of each, with their frequencies),
//! and a search scores them with the same BM25 as the committed documents, over statistics
//! that count both ([`WithTail`]). A fresh write is therefore found as soon as it is added,
//! at the score the commit will give it, and the commit only makes it durable. A commit
//! empties the tail under the same lock a search takes its searcher under, so no search sees
//! a document twice or not at all.
//!
//! Nothing here is durable: after a crash the tail is gone with the uncommitted documents, and
//! the projector replays them from the stream after the last commit.

use std::collections::{BTreeMap, HashMap};

use engram_memory::{Hit, MemoryFilter, MemoryMeta, ScopeKey, Seq};
use tantivy::fieldnorm::FieldNormReader;
use tantivy::query::{Bm25StatisticsProvider, Bm25Weight};
use tantivy::schema::Field;
use tantivy::tokenizer::{TextAnalyzer, TokenStream};
use tantivy::{Searcher, Term};

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
    total_tokens: u64,
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
        self.total_tokens += u64::from(tokens);
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
        self.total_tokens -= u64::from(doc.tokens);
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
    /// passing `filter`, scored by BM25 with the statistics `stats` gives: the sum over the
    /// terms a document holds, as tantivy's boolean query of the same terms sums them.
    pub(crate) fn search(
        &self,
        stats: &dyn Bm25StatisticsProvider,
        terms: &[Term],
        scopes: &[ScopeKey],
        filter: &MemoryFilter,
    ) -> tantivy::Result<Vec<Hit>> {
        let mut scores: HashMap<Seq, f32> = HashMap::new();
        for term in terms {
            let value = term.value();
            let Some(text) = value.as_str() else {
                continue;
            };
            let Some(docs) = self.postings.get(text) else {
                continue;
            };
            let weight = Bm25Weight::for_terms(stats, std::slice::from_ref(term))?;
            for (seq, tf) in docs {
                let doc = &self.docs[seq];
                if !scopes.contains(&doc.meta.scope) || !filter.matches(&doc.meta) {
                    continue;
                }
                let norm = FieldNormReader::fieldnorm_to_id(doc.tokens);
                *scores.entry(*seq).or_default() += weight.score(norm, *tf);
            }
        }
        Ok(scores
            .into_iter()
            .map(|(seq, score)| Hit { seq, score })
            .collect())
    }
}

/// What BM25 needs of the tail for one query: its documents, their tokens, and how many of
/// them hold each query term. Taken under the tail's lock, so that the committed search can
/// run after it is released.
pub(crate) struct TailStats {
    docs: u64,
    tokens: u64,
    doc_freqs: HashMap<String, u64>,
}

impl TailSegment {
    pub(crate) fn stats(&self, terms: &[Term]) -> TailStats {
        TailStats {
            docs: self.docs.len() as u64,
            tokens: self.total_tokens,
            doc_freqs: terms
                .iter()
                .filter_map(|t| {
                    let value = t.value();
                    let text = value.as_str()?;
                    Some((text.to_owned(), self.postings.get(text)?.len() as u64))
                })
                .collect(),
        }
    }
}

/// BM25 statistics over the committed documents and the tail together: what the index will
/// hold once the tail is committed.
pub(crate) struct WithTail<'a> {
    pub(crate) searcher: &'a Searcher,
    pub(crate) tail: &'a TailStats,
    /// The text field, the only one whose terms score.
    pub(crate) text: Field,
}

impl Bm25StatisticsProvider for WithTail<'_> {
    fn total_num_tokens(&self, field: Field) -> tantivy::Result<u64> {
        let committed = Bm25StatisticsProvider::total_num_tokens(self.searcher, field)?;
        Ok(committed
            + if field == self.text {
                self.tail.tokens
            } else {
                0
            })
    }

    fn total_num_docs(&self) -> tantivy::Result<u64> {
        Ok(Bm25StatisticsProvider::total_num_docs(self.searcher)? + self.tail.docs)
    }

    fn doc_freq(&self, term: &Term) -> tantivy::Result<u64> {
        let committed = self.searcher.doc_freq(term)?;
        let tail = if term.field() == self.text {
            let value = term.value();
            value
                .as_str()
                .and_then(|t| self.tail.doc_freqs.get(t))
                .copied()
                .unwrap_or(0)
        } else {
            0
        };
        Ok(committed + tail)
    }
}
