//! Turning user text, scopes and a filter into a tantivy query, without tantivy's query parser.
//!
//! User text only ever becomes analysed terms: punctuation, quotes, `field:value`, `AND`,
//! `*` and the like have no meaning here, so no text can fail to parse, widen a search to
//! other fields, or escape its scopes.

use std::ops::Bound;

use engram_memory::{MemoryFilter, ScopeKey};
use tantivy::Term;
use tantivy::query::{BooleanQuery, ConstScoreQuery, Occur, Query, RangeQuery, TermQuery};
use tantivy::schema::{Field, IndexRecordOption};
use tantivy::tokenizer::{TextAnalyzer, TokenStream};

use crate::schema::{Fields, scope_term, unix_nanos};

/// Most distinct terms a text query searches for.
pub const MAX_QUERY_TERMS: usize = 256;

/// The distinct analysed terms of `text`, in a fixed order, at most [`MAX_QUERY_TERMS`].
///
/// Repeating a word does not weigh it more: a query is a set of terms.
pub(crate) fn text_terms(
    analyzer: &TextAnalyzer,
    query_analyzer: &TextAnalyzer,
    field: Field,
    text: &str,
) -> Vec<Term> {
    let tokens_of = |analyzer: &TextAnalyzer| {
        // `token_stream` needs `&mut`; a clone keeps searches free of a shared lock.
        let mut analyzer = analyzer.clone();
        let mut stream = analyzer.token_stream(text);
        let mut tokens = Vec::new();
        while stream.advance() {
            tokens.push(stream.token().text.clone());
        }
        tokens
    };
    // Without function words, unless the query is nothing else ("to be or not to be").
    let mut tokens = tokens_of(query_analyzer);
    if tokens.is_empty() {
        tokens = tokens_of(analyzer);
    }
    tokens.sort_unstable();
    tokens.dedup();
    // Each term is a posting-list scorer held for the whole search; a query of thousands of
    // distinct words would cost memory and time in proportion and rank no better. Which
    // terms stay is arbitrary (sorted order); a query this long is not a question.
    tokens.truncate(MAX_QUERY_TERMS);
    tokens
        .iter()
        .map(|token| Term::from_field_text(field, token))
        .collect()
}

/// The full query, or `None` when it can match nothing (no terms, no scopes, or a filter no
/// memory can pass), so the caller skips the search.
///
/// Only the text terms score. Scope and filter clauses are wrapped to score zero: a scope
/// term's idf differs between scopes, and letting it count would rank memories of a small
/// scope above better matches from a large one in a multi-scope query.
pub(crate) fn build(
    fields: &Fields,
    terms: Vec<Term>,
    scopes: &[ScopeKey],
    filter: &MemoryFilter,
) -> Option<Box<dyn Query>> {
    if terms.is_empty() || scopes.is_empty() {
        return None;
    }
    let text: Box<dyn Query> = Box::new(BooleanQuery::new(
        terms
            .into_iter()
            .map(|term| {
                let query: Box<dyn Query> =
                    Box::new(TermQuery::new(term, IndexRecordOption::WithFreqs));
                (Occur::Should, query)
            })
            .collect(),
    ));

    let mut restrictions: Vec<Box<dyn Query>> = vec![self::scopes(fields, scopes)];
    if !filter.layers.is_empty() {
        restrictions.push(any_of(
            filter
                .layers
                .iter()
                .map(|layer| Term::from_field_text(fields.layer, layer.as_str()))
                .collect(),
        ));
    }
    if !filter.kinds.is_empty() {
        restrictions.push(any_of(
            filter
                .kinds
                .iter()
                .map(|kind| Term::from_field_text(fields.kind, kind.as_str()))
                .collect(),
        ));
    }
    if !filter.tags.is_empty() {
        restrictions.push(any_of(
            filter
                .tags
                .iter()
                .map(|tag| Term::from_field_text(fields.tags, tag))
                .collect(),
        ));
    }
    if filter.since.is_some() || filter.until.is_some() {
        let since = filter.since.as_ref().map(unix_nanos);
        let until = filter.until.as_ref().map(unix_nanos);
        if let (Some(since), Some(until)) = (since, until)
            && since >= until
        {
            return None;
        }
        let term = |nanos: i64| Term::from_field_i64(fields.occurred_at, nanos);
        restrictions.push(Box::new(RangeQuery::new(
            since.map_or(Bound::Unbounded, |s| Bound::Included(term(s))),
            until.map_or(Bound::Unbounded, |u| Bound::Excluded(term(u))),
        )));
    }
    if let Some(min) = filter.min_importance {
        // `importance >= NaN` holds for no memory, as in `MemoryFilter::matches`.
        if min.is_nan() {
            return None;
        }
        restrictions.push(Box::new(RangeQuery::new(
            Bound::Included(Term::from_field_f64(fields.importance, min)),
            Bound::Unbounded,
        )));
    }

    if let Some(min) = filter.min_confidence {
        if min.is_nan() {
            return None;
        }
        restrictions.push(Box::new(RangeQuery::new(
            Bound::Included(Term::from_field_f64(fields.confidence, min)),
            Bound::Unbounded,
        )));
    }

    let restrictions = BooleanQuery::new(
        restrictions
            .into_iter()
            .map(|query| (Occur::Must, query))
            .collect(),
    );
    Some(Box::new(BooleanQuery::new(vec![
        (Occur::Must, text),
        (
            Occur::Must,
            Box::new(ConstScoreQuery::new(Box::new(restrictions), 0.0)),
        ),
    ])))
}

/// Matches exactly the documents of `scopes`.
pub(crate) fn scopes(fields: &Fields, scopes: &[ScopeKey]) -> Box<dyn Query> {
    any_of(
        scopes
            .iter()
            .map(|scope| scope_term(fields, scope))
            .collect(),
    )
}

/// Matches documents carrying at least one of `terms`, each compared whole.
fn any_of(terms: Vec<Term>) -> Box<dyn Query> {
    Box::new(BooleanQuery::new(
        terms
            .into_iter()
            .map(|term| {
                let query: Box<dyn Query> =
                    Box::new(TermQuery::new(term, IndexRecordOption::Basic));
                (Occur::Should, query)
            })
            .collect(),
    ))
}
