//! Why a healthy system once failed the load test with "came back from only one index: dense
//! Some(0.0), keyword None", and why the recall check can no longer report that.
//!
//! The recall asked a random workload question filtered to the write's marker tag. The keyword
//! index scores text terms only, so it can return the write only if the question shares an
//! analysed term with the text. Questions are "why the <noun> <verb phrase>"; texts share "the"
//! with them by habit, not by construction, and `fit_text` cuts a text to its target length
//! mid-word when no space falls late enough. The run the issue reported (seed
//! 2136044108539410522, `--embedder client --instances 1000 --rate 500 --duration 60`), run
//! again with the query and text added to the report, failed the same way on this write:
//! its only "the" had been cut to "th".

use std::collections::HashSet;

use engram_keyword::KeywordIndex;
use engram_loadtest::fleet::workload_of;
use engram_memory::{MemoryFilter, MemoryMeta, ScopeKey};
use engram_schema::Layer;
use tantivy::tokenizer::TokenStream;

/// The invisible write of the reproduced run, and the question its recall asked.
const TEXT: &str = "Ran `curl -sv https://staging.internal/health` in migrations/0042_add_index.sql to check whether th. (ref-1137f5f84692)";
const QUESTION: &str = "why the CSV importer retries without backoff";
const MARKER: &str = "ref-1137f5f84692";

fn terms(text: &str) -> HashSet<String> {
    let mut analyzer = engram_keyword::schema::analyzer();
    let mut stream = analyzer.token_stream(text);
    let mut out = HashSet::new();
    while stream.advance() {
        out.insert(stream.token().text.clone());
    }
    out
}

#[test]
fn the_reported_write_shares_no_term_with_its_question_and_the_index_finds_it_only_by_marker() {
    assert!(
        terms(TEXT).is_disjoint(&terms(QUESTION)),
        "{:?} / {:?}",
        terms(TEXT),
        terms(QUESTION)
    );
    let mut event = engram_testkit::event("loadtest", "team-0042", TEXT);
    event.tags = vec!["customer".into(), MARKER.into()];
    let mut index = KeywordIndex::in_ram().unwrap();
    index.add(&MemoryMeta::of(16246, &event), TEXT).unwrap();
    index.commit(16246).unwrap();
    let scopes = [ScopeKey::of(&event)];
    let filter = MemoryFilter {
        tags: vec![MARKER.into()],
        ..MemoryFilter::default()
    };

    // The old recall: the question, filtered to the marker. The write is the only memory the
    // filter admits, and the keyword index still returns nothing, as in the run.
    let by_question = index.search(QUESTION, &scopes, &filter, 5).unwrap();
    assert!(by_question.is_empty(), "{by_question:?}");
    // The recall now: the marker, which the text carries.
    let by_marker = index.search(MARKER, &scopes, &filter, 5).unwrap();
    assert_eq!(
        by_marker.iter().map(|h| h.seq).collect::<Vec<_>>(),
        vec![16246]
    );
}

/// The recall now asks with the marker the run appends to every text memory: its terms must
/// survive analysis, for every kind of text the workload writes.
#[test]
fn every_text_write_of_the_workload_holds_its_markers_terms() {
    for index in 0..1000 {
        let mut workload = workload_of(2136044108539410522, index, 5);
        for n in 0..5 {
            let mut event = workload.next_event();
            if !matches!(event.layer, Layer::Episodic | Layer::Semantic) {
                continue;
            }
            let marker = format!("ref-{:06x}{n:06x}", index);
            event.content.text.push_str(&format!(" ({marker})"));
            let (marker_terms, text_terms) = (terms(&marker), terms(&event.content.text));
            assert_eq!(marker_terms.len(), 2, "{marker_terms:?}");
            assert!(
                marker_terms.is_subset(&text_terms),
                "{marker} not in {:?}",
                event.content.text
            );
        }
    }
}
