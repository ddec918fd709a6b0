//! BM25 statistics of the scopes a search asks, not of the whole index.
//!
//! One index holds a partition, and a partition holds whatever scopes (of whatever tenants)
//! hash to it. Tantivy's own statistics (documents, tokens, and how many documents hold a
//! term) count all of them, so a scope's ranking moved with its neighbours': which scopes
//! share its partition depends on the tenant's name, and LoCoMo's BM25 recall on the same
//! conversations changed from run to run (0.565 or 0.579, by the random tenant name). It was
//! also a side channel: how often a term occurs in another tenant's memories shifted the
//! scores this tenant saw. The statistics here count only the searched scopes' live
//! documents, committed and in the tail together, so a scope ranks the same wherever it
//! lives, and alone.
//!
//! Document lengths are summed as their field norms (tantivy's one-byte lengths), the tail's
//! too, so that a document counts the same before and after its commit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tantivy::collector::{Collector, Count, SegmentCollector};
use tantivy::fieldnorm::{FieldNormReader, FieldNormReaders};
use tantivy::query::{Bm25StatisticsProvider, BooleanQuery, Occur, Query, TermQuery};
use tantivy::schema::{Field, IndexRecordOption};
use tantivy::{DocId, Score, Searcher, SegmentOrdinal, SegmentReader, Term};

use crate::tail::TailStats;

/// Most scope sets whose committed totals are kept for one commit: a search asks one scope
/// and its grants, so a few hundred sets cover the busy ones; past this the cache starts over.
const CACHED_SCOPE_SETS: usize = 1024;

/// The searched scopes' totals in the committed index, per commit (searcher generation) and
/// scope set: they change only when a commit lands, and summing them reads every document of
/// the scopes.
#[derive(Clone, Default)]
pub(crate) struct TotalsCache(Arc<Mutex<CachedTotals>>);

/// The generation counted, and each scope set's (sorted scope tokens) totals in it.
type CachedTotals = (u64, HashMap<Vec<String>, Totals>);

/// Live documents and their summed lengths (field norms) in the text field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub(crate) docs: u64,
    pub(crate) tokens: u64,
}

impl TotalsCache {
    /// The committed totals of the documents `scopes` (a query matching exactly the searched
    /// scopes' documents) selects, keyed by `key`.
    pub(crate) fn committed(
        &self,
        searcher: &Searcher,
        text: Field,
        key: Vec<String>,
        scopes: &dyn Query,
    ) -> tantivy::Result<Totals> {
        let generation = searcher.generation().generation_id();
        {
            let cache = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if cache.0 == generation
                && let Some(totals) = cache.1.get(&key)
            {
                return Ok(*totals);
            }
        }
        let totals = searcher.search(scopes, &SumLengths { text })?;
        let mut cache = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if cache.0 != generation || cache.1.len() >= CACHED_SCOPE_SETS {
            *cache = (generation, HashMap::new());
        }
        cache.1.insert(key, totals);
        Ok(totals)
    }
}

/// Counts the documents it is given and sums their text's field norms.
struct SumLengths {
    text: Field,
}

struct SegmentSum {
    norms: FieldNormReader,
    totals: Totals,
}

impl Collector for SumLengths {
    type Fruit = Totals;
    type Child = SegmentSum;

    fn for_segment(
        &self,
        _segment: SegmentOrdinal,
        reader: &SegmentReader,
    ) -> tantivy::Result<SegmentSum> {
        let norms: &FieldNormReaders = reader.fieldnorms_readers();
        Ok(SegmentSum {
            norms: norms.get_field(self.text)?.unwrap_or_else(|| {
                // A segment without norms for the field holds no text in it.
                FieldNormReader::constant(reader.max_doc(), 0)
            }),
            totals: Totals::default(),
        })
    }

    fn requires_scoring(&self) -> bool {
        false
    }

    fn merge_fruits(&self, fruits: Vec<Totals>) -> tantivy::Result<Totals> {
        Ok(fruits.into_iter().fold(Totals::default(), |a, b| Totals {
            docs: a.docs + b.docs,
            tokens: a.tokens + b.tokens,
        }))
    }
}

impl SegmentCollector for SegmentSum {
    type Fruit = Totals;

    fn collect(&mut self, doc: DocId, _score: Score) {
        self.totals.docs += 1;
        self.totals.tokens += u64::from(self.norms.fieldnorm(doc));
    }

    fn harvest(self) -> Totals {
        self.totals
    }
}

/// A length as tantivy stores it (one byte, exact up to 40, coarser above): what a tail
/// document will count once committed.
pub(crate) fn stored_length(tokens: u32) -> u64 {
    u64::from(FieldNormReader::id_to_fieldnorm(
        FieldNormReader::fieldnorm_to_id(tokens),
    ))
}

/// BM25 statistics of the searched scopes: their live documents, committed and in the tail.
/// Terms of other fields than the text (never scored: the restrictions are constant-score)
/// keep the searcher's own.
pub(crate) struct ScopedStats<'a> {
    searcher: &'a Searcher,
    text: Field,
    totals: Totals,
    doc_freqs: HashMap<Term, u64>,
}

impl<'a> ScopedStats<'a> {
    /// Counts, for each of `terms` (the query's analysed text terms), the searched scopes'
    /// committed documents holding it (`scopes` matches exactly those) and adds the tail's.
    pub(crate) fn new(
        searcher: &'a Searcher,
        text: Field,
        committed: Totals,
        scopes: &dyn Query,
        terms: &[Term],
        tail: &TailStats,
    ) -> tantivy::Result<Self> {
        let mut doc_freqs = HashMap::with_capacity(terms.len());
        for term in terms {
            if doc_freqs.contains_key(term) {
                continue;
            }
            let holding = BooleanQuery::new(vec![
                (
                    Occur::Must,
                    Box::new(TermQuery::new(term.clone(), IndexRecordOption::Basic))
                        as Box<dyn Query>,
                ),
                (Occur::Must, scopes.box_clone()),
            ]);
            let committed = searcher.search(&holding, &Count)? as u64;
            doc_freqs.insert(term.clone(), committed + tail.doc_freq(term));
        }
        Ok(Self {
            searcher,
            text,
            totals: Totals {
                docs: committed.docs + tail.docs,
                tokens: committed.tokens + tail.tokens,
            },
            doc_freqs,
        })
    }
}

impl Bm25StatisticsProvider for ScopedStats<'_> {
    fn total_num_tokens(&self, field: Field) -> tantivy::Result<u64> {
        if field == self.text {
            Ok(self.totals.tokens)
        } else {
            Bm25StatisticsProvider::total_num_tokens(self.searcher, field)
        }
    }

    fn total_num_docs(&self) -> tantivy::Result<u64> {
        Ok(self.totals.docs)
    }

    fn doc_freq(&self, term: &Term) -> tantivy::Result<u64> {
        match self.doc_freqs.get(term) {
            Some(n) => Ok(*n),
            None if term.field() == self.text => Ok(0),
            None => self.searcher.doc_freq(term),
        }
    }
}
