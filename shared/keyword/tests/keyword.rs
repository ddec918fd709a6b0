//! The keyword read model, given/when/then: given these memories, when this happens, then the
//! index answers exactly this.

use std::collections::BTreeSet;
use std::slice::from_ref;

use chrono::{DateTime, Duration, TimeZone, Utc};
use engram_keyword::{KeywordError, KeywordIndex, KeywordReader};
use engram_memory::{Hit, MemoryFilter, MemoryMeta, ScopeKey, Seq};
use engram_schema::{EventId, EventKind, Ident, Layer, Scope, ScopeKind};

fn ident(value: &str) -> Ident {
    Ident::parse("test", value).unwrap()
}

fn scope(tenant: &str, kind: ScopeKind, id: &str) -> ScopeKey {
    ScopeKey::new(ident(tenant), Scope::new(kind, id).unwrap())
}

fn team(id: &str) -> ScopeKey {
    scope("acme", ScopeKind::Team, id)
}

fn epoch() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap()
}

/// An episodic observation in `scope`, at `epoch() + seq` seconds, importance 0.5, no tags.
fn meta(seq: Seq, scope: &ScopeKey) -> MemoryMeta {
    MemoryMeta {
        seq,
        event_id: EventId::new(),
        scope: scope.clone(),
        agent_id: ident("agent-1"),
        layer: Layer::Episodic,
        kind: EventKind::Observation,
        occurred_at: epoch() + Duration::seconds(seq as i64),
        importance: 0.5,
        tags: Vec::new(),
        instance_id: Some(ident("i-1")),
        confidence: 1.0,
    }
}

fn any() -> MemoryFilter {
    MemoryFilter::default()
}

fn seqs(hits: &[Hit]) -> Vec<Seq> {
    hits.iter().map(|hit| hit.seq).collect()
}

fn seq_set(hits: &[Hit]) -> BTreeSet<Seq> {
    hits.iter().map(|hit| hit.seq).collect()
}

/// An in-RAM index holding `texts` in `scope` as sequences 1, 2, …, committed.
fn index_with(scope: &ScopeKey, texts: &[&str]) -> KeywordIndex {
    let mut index = KeywordIndex::in_ram().unwrap();
    for (i, text) in texts.iter().enumerate() {
        index.add(&meta(i as Seq + 1, scope), text).unwrap();
    }
    index.commit(texts.len() as Seq).unwrap();
    index
}

#[test]
fn ranking_prefers_documents_matching_more_and_rarer_query_terms() {
    // given
    let a = team("a");
    let index = index_with(
        &a,
        &[
            "the deployment failed because the database migration timed out",
            "database backups run nightly",
            "lunch was pizza again",
            "the migration of the billing service is planned",
        ],
    );
    // when
    let hits = index
        .search("database migration failed", from_ref(&a), &any(), 10)
        .unwrap();
    // then: the memory with all three terms first; the unrelated one absent
    assert_eq!(hits.first().map(|h| h.seq), Some(1), "{hits:?}");
    assert_eq!(seq_set(&hits), BTreeSet::from([1, 2, 4]));
    assert!(
        hits.windows(2).all(|w| w[0].score >= w[1].score),
        "{hits:?}"
    );
    assert!(hits.iter().all(|h| h.score > 0.0));
}

#[test]
fn stemming_and_case_folding_match_word_variants() {
    let a = team("a");
    let index = index_with(&a, &["Deployments FAILED twice", "nothing relevant"]);
    let hits = index
        .search("failing deployment", &[a], &any(), 10)
        .unwrap();
    assert_eq!(seqs(&hits), vec![1]);
}

#[test]
fn higher_term_frequency_in_equal_length_documents_scores_higher() {
    let a = team("a");
    let index = index_with(
        &a,
        &[
            "cache miss on the cache layer",
            "cache miss on the disk layer",
        ],
    );
    let hits = index.search("cache", &[a], &any(), 10).unwrap();
    assert_eq!(seqs(&hits), vec![1, 2]);
    assert!(hits[0].score > hits[1].score, "{hits:?}");
}

#[test]
fn k_limits_results_and_extreme_k_is_safe() {
    let a = team("a");
    let index = index_with(&a, &["alpha one", "alpha two", "alpha three"]);
    assert_eq!(
        index
            .search("alpha", from_ref(&a), &any(), 2)
            .unwrap()
            .len(),
        2
    );
    assert!(
        index
            .search("alpha", from_ref(&a), &any(), 0)
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        index
            .search("alpha", &[a], &any(), usize::MAX)
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn scopes_match_whole_tokens_only() {
    // given: the same text in look-alike scopes
    let lookalikes = [
        team("team-a"),                            // 1: the one searched
        team("team-ab"),                           // 2: prefix sibling
        team("Team-A"),                            // 3: case variant
        team("team"),                              // 4: prefix of the id
        scope("other", ScopeKind::Team, "team-a"), // 5: another tenant, same scope id
        scope("acme", ScopeKind::Task, "team-a"),  // 6: another kind, same id
        scope("acme2", ScopeKind::Team, "team-a"), // 7: tenant prefix sibling
    ];
    let mut index = KeywordIndex::in_ram().unwrap();
    for (i, scope) in lookalikes.iter().enumerate() {
        index
            .add(&meta(i as Seq + 1, scope), "the shared secret plan")
            .unwrap();
    }
    index.commit(lookalikes.len() as Seq).unwrap();

    // when / then: each scope sees exactly its own memory
    for (i, scope) in lookalikes.iter().enumerate() {
        let hits = index
            .search("secret plan", from_ref(scope), &any(), 10)
            .unwrap();
        assert_eq!(seqs(&hits), vec![i as Seq + 1], "scope {scope}");
    }
    // and several scopes see the union of exactly those
    let hits = index
        .search(
            "secret",
            &[lookalikes[0].clone(), lookalikes[4].clone()],
            &any(),
            10,
        )
        .unwrap();
    assert_eq!(seq_set(&hits), BTreeSet::from([1, 5]));
}

#[test]
fn no_scopes_means_no_results() {
    let a = team("a");
    let index = index_with(&a, &["anything at all"]);
    assert!(
        index
            .search("anything", &[], &any(), 10)
            .unwrap()
            .is_empty()
    );
}

#[test]
fn scope_terms_do_not_affect_scores() {
    // given: one memory alone in a small scope, the same text among many in a big one
    let (small, big) = (team("small"), team("big"));
    let mut index = KeywordIndex::in_ram().unwrap();
    index.add(&meta(1, &small), "rollback the release").unwrap();
    index.add(&meta(2, &big), "rollback the release").unwrap();
    for seq in 3..40 {
        index.add(&meta(seq, &big), "unrelated chatter").unwrap();
    }
    index.commit(39).unwrap();
    // when
    let hits = index.search("rollback", &[small, big], &any(), 10).unwrap();
    // then: identical texts score identically, whatever their scope's size
    assert_eq!(hits.len(), 2);
    assert_eq!(hits[0].score, hits[1].score, "{hits:?}");
}

#[test]
fn query_text_is_never_syntax() {
    // given
    let (a, b) = (team("a"), team("b"));
    let mut index = KeywordIndex::in_ram().unwrap();
    index.add(&meta(1, &a), "foo bar baz").unwrap();
    index.add(&meta(2, &b), "secret of team b").unwrap();
    index.commit(2).unwrap();

    // when / then: operators and field syntax neither error nor change the meaning
    let weird = [
        "\"foo:bar AND (*",
        "foo:bar AND (*",
        "text:foo",
        "scope:acme/team/b secret",
        "foo OR NOT bar",
        "+foo -bar ~baz^2",
        "\"unterminated",
        "[1 TO *]",
        "foo\\",
        "(((((",
        "foo\u{0}bar",
    ];
    for text in weird {
        let hits = index.search(text, from_ref(&a), &any(), 10).unwrap();
        assert!(hits.iter().all(|h| h.seq == 1), "{text:?} -> {hits:?}");
    }
    assert_eq!(
        seqs(
            &index
                .search("foo:bar AND (*", from_ref(&a), &any(), 10)
                .unwrap()
        ),
        vec![1]
    );
    // a scope written into the text does not widen the search
    assert!(
        index
            .search("scope:acme/team/b secret", from_ref(&a), &any(), 10)
            .unwrap()
            .is_empty()
    );
    // text without words matches nothing
    let long_token = "x".repeat(10_000);
    for text in ["", "   ", "🦀🔥", "*", "::", "\"\"", long_token.as_str()] {
        let hits = index.search(text, from_ref(&a), &any(), 10).unwrap();
        assert!(hits.is_empty(), "{text:?} -> {hits:?}");
    }
    // non-ascii words are words
    index.add(&meta(3, &a), "Ein Café in Köln 🦀").unwrap();
    index.commit(3).unwrap();
    assert_eq!(
        seqs(&index.search("café KÖLN", &[a], &any(), 10).unwrap()),
        vec![3]
    );
}

/// A small world of memories whose every attribute varies, searched with many filters; the
/// index must agree with `MemoryFilter::matches`, the definition every read model shares.
#[test]
fn filters_agree_with_memory_filter_matches() {
    // given
    let a = team("a");
    let layers = [Layer::Episodic, Layer::Semantic];
    let kinds = [
        EventKind::Observation,
        EventKind::Action,
        EventKind::Outcome,
    ];
    let tag_sets: [&[&str]; 4] = [&[], &["ops"], &["ops", "db"], &["DB"]];
    let mut metas = Vec::new();
    let mut index = KeywordIndex::in_ram().unwrap();
    for seq in 1..=48u64 {
        let mut m = meta(seq, &a);
        m.layer = layers[seq as usize % 2];
        m.kind = kinds[seq as usize % 3];
        m.tags = tag_sets[seq as usize % 4]
            .iter()
            .map(|t| t.to_string())
            .collect();
        m.importance = (seq % 5) as f64 / 4.0;
        m.confidence = 0.5f64.powi((seq % 4) as i32);
        // sub-second times, so the range bounds are tested at full precision
        m.occurred_at = epoch() + Duration::nanoseconds(seq as i64 * 1_000_000_007);
        index.add(&m, "incident report").unwrap();
        metas.push(m);
    }
    index.commit(48).unwrap();

    let at = |seq: i64| epoch() + Duration::nanoseconds(seq * 1_000_000_007);
    let filters = [
        MemoryFilter::default(),
        MemoryFilter {
            layers: vec![Layer::Semantic],
            ..any()
        },
        MemoryFilter {
            layers: vec![Layer::Semantic, Layer::Episodic],
            ..any()
        },
        MemoryFilter {
            layers: vec![Layer::Procedural],
            ..any()
        },
        MemoryFilter {
            kinds: vec![EventKind::Action],
            ..any()
        },
        MemoryFilter {
            kinds: vec![EventKind::Action, EventKind::Outcome],
            ..any()
        },
        MemoryFilter {
            tags: vec!["ops".into()],
            ..any()
        },
        MemoryFilter {
            tags: vec!["db".into()],
            ..any()
        },
        MemoryFilter {
            tags: vec!["db".into(), "DB".into()],
            ..any()
        },
        MemoryFilter {
            tags: vec!["o".into()],
            ..any()
        },
        MemoryFilter {
            since: Some(at(10)),
            ..any()
        },
        MemoryFilter {
            since: Some(at(10) + Duration::nanoseconds(1)),
            ..any()
        },
        MemoryFilter {
            until: Some(at(10)),
            ..any()
        },
        MemoryFilter {
            until: Some(at(10) + Duration::nanoseconds(1)),
            ..any()
        },
        MemoryFilter {
            since: Some(at(5)),
            until: Some(at(20)),
            ..any()
        },
        MemoryFilter {
            since: Some(at(20)),
            until: Some(at(5)),
            ..any()
        },
        MemoryFilter {
            min_importance: Some(0.5),
            ..any()
        },
        MemoryFilter {
            min_importance: Some(1.0),
            ..any()
        },
        MemoryFilter {
            min_importance: Some(f64::NAN),
            ..any()
        },
        MemoryFilter {
            min_importance: Some(f64::NEG_INFINITY),
            ..any()
        },
        MemoryFilter {
            layers: vec![Layer::Episodic],
            kinds: vec![EventKind::Observation, EventKind::Outcome],
            tags: vec!["ops".into()],
            since: Some(at(3)),
            until: Some(at(40)),
            min_importance: Some(0.25),
            min_confidence: None,
        },
        MemoryFilter {
            min_confidence: Some(0.5),
            ..any()
        },
        MemoryFilter {
            min_confidence: Some(0.6),
            ..any()
        },
        MemoryFilter {
            min_confidence: Some(0.0),
            ..any()
        },
        MemoryFilter {
            min_confidence: Some(f64::NAN),
            ..any()
        },
        MemoryFilter {
            min_importance: Some(0.5),
            min_confidence: Some(0.25),
            ..any()
        },
    ];

    for filter in &filters {
        // when
        let hits = index.search("incident", from_ref(&a), filter, 100).unwrap();
        // then
        let expected: BTreeSet<Seq> = metas
            .iter()
            .filter(|m| filter.matches(m))
            .map(|m| m.seq)
            .collect();
        assert_eq!(seq_set(&hits), expected, "{filter:?}");
    }
}

#[test]
fn checkpoint_survives_reopen_and_uncommitted_work_does_not() {
    // given: a committed batch, then a staged one that is never committed
    let dir = tempfile::tempdir().unwrap();
    let a = team("a");
    {
        let mut index = KeywordIndex::open(dir.path()).unwrap();
        assert_eq!(index.committed_seq(), 0);
        index.add(&meta(1, &a), "committed memory").unwrap();
        index.add(&meta(2, &a), "committed memory too").unwrap();
        index.commit(2).unwrap();
        index.add(&meta(3, &a), "staged memory").unwrap();
        index.delete(1).unwrap();
    } // when: the process stops without committing

    // then: the index and its checkpoint are both those of the last commit
    let index = KeywordIndex::open(dir.path()).unwrap();
    assert_eq!(index.committed_seq(), 2);
    assert_eq!(index.doc_count(), 2);
    let hits = index.search("memory", &[a], &any(), 10).unwrap();
    assert_eq!(seq_set(&hits), BTreeSet::from([1, 2]));
}

#[test]
fn a_commit_note_survives_reopen_and_clear_drops_it() {
    // given: a commit with a note, then one without
    let dir = tempfile::tempdir().unwrap();
    let a = team("a");
    {
        let mut index = KeywordIndex::open(dir.path()).unwrap();
        assert_eq!(index.committed_note(), None);
        index.add(&meta(1, &a), "noted memory").unwrap();
        index
            .commit_with_note(1, "{\"seq\":1}\nsecond line")
            .unwrap();
        assert_eq!(index.committed_note(), Some("{\"seq\":1}\nsecond line"));
    }
    // then: a reopen finds sequence and note of the last commit
    let mut index = KeywordIndex::open(dir.path()).unwrap();
    assert_eq!(index.committed_seq(), 1);
    assert_eq!(index.committed_note(), Some("{\"seq\":1}\nsecond line"));
    index.commit(1).unwrap();
    assert_eq!(index.committed_note(), None);
    index.commit_with_note(1, "again").unwrap();
    index.clear().unwrap();
    drop(index);
    let index = KeywordIndex::open(dir.path()).unwrap();
    assert_eq!((index.committed_seq(), index.committed_note()), (0, None));
}

#[test]
fn replaying_after_reopen_does_not_duplicate() {
    // given: memories 1..=3 committed, the process restarted
    let dir = tempfile::tempdir().unwrap();
    let a = team("a");
    {
        let mut index = KeywordIndex::open(dir.path()).unwrap();
        for seq in 1..=3 {
            index.add(&meta(seq, &a), "replayed memory").unwrap();
        }
        index.commit(3).unwrap();
    }
    let mut index = KeywordIndex::open(dir.path()).unwrap();
    let before = index.state_hash().unwrap();
    // when: an at-least-once projector applies 2 and 3 again
    for seq in 2..=3 {
        index.add(&meta(seq, &a), "replayed memory").unwrap();
    }
    index.commit(3).unwrap();
    // then
    assert_eq!(index.doc_count(), 3);
    assert_eq!(index.state_hash().unwrap(), before);
}

#[test]
fn adding_an_existing_sequence_replaces_it() {
    let a = team("a");
    let mut index = index_with(&a, &["old words"]);
    index.add(&meta(1, &a), "new words").unwrap();
    index.add(&meta(1, &a), "newest words").unwrap();
    index.commit(1).unwrap();
    assert_eq!(index.doc_count(), 1);
    assert!(
        index
            .search("old new", from_ref(&a), &any(), 10)
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        seqs(&index.search("newest", &[a], &any(), 10).unwrap()),
        vec![1]
    );
}

/// A memory whose confidence a later event lowered is added again under its sequence: the
/// new confidence filters in the index, and without the filter it is found as before.
#[test]
fn a_memory_added_again_with_lower_confidence_is_filtered_by_it() {
    let a = team("a");
    let mut index = index_with(&a, &["the deploy key rotates weekly", "deploy on fridays"]);
    let before = seqs(&index.search("deploy", from_ref(&a), &any(), 10).unwrap());
    let trusted = MemoryFilter {
        min_confidence: Some(0.6),
        ..any()
    };
    let mut lowered = meta(1, &a);
    lowered.confidence = 0.5;
    index
        .add(&lowered, "the deploy key rotates weekly")
        .unwrap();
    index.commit(3).unwrap();
    assert_eq!(index.doc_count(), 2);
    assert_eq!(
        seqs(&index.search("deploy", from_ref(&a), &any(), 10).unwrap()),
        before
    );
    assert_eq!(
        seqs(&index.search("deploy", from_ref(&a), &trusted, 10).unwrap()),
        vec![2]
    );
    let stored = index.reader().stored_all().unwrap();
    assert_eq!(stored[0].0.confidence, 0.5);
    assert_eq!(stored[1].0.confidence, 1.0);
}

#[test]
fn a_second_writer_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = KeywordIndex::open(dir.path()).unwrap();
    let second = KeywordIndex::open(dir.path());
    assert!(matches!(second, Err(KeywordError::Locked { .. })));
}

/// A memory node that loses a partition's lease and takes it back at once opens the index
/// again while the old instance's writer is still being dropped: the open waits for it
/// instead of failing (which left the partition's keyword model without an index).
#[test]
fn an_index_released_while_another_open_waits_is_opened() {
    let dir = tempfile::tempdir().unwrap();
    let first = KeywordIndex::open(dir.path()).unwrap();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(500));
        drop(first);
    });
    let second = KeywordIndex::open(dir.path());
    releaser.join().unwrap();
    assert!(second.is_ok(), "{:?}", second.err());
}

#[test]
fn an_index_of_another_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut builder = tantivy::schema::Schema::builder();
    builder.add_text_field("body", tantivy::schema::TEXT);
    drop(tantivy::Index::create_in_dir(dir.path(), builder.build()).unwrap());
    let opened = KeywordIndex::open(dir.path());
    assert!(matches!(opened, Err(KeywordError::SchemaMismatch { .. })));
}

#[test]
fn checkpoint_never_moves_back() {
    let a = team("a");
    let mut index = index_with(&a, &["one", "two", "three"]);
    assert!(matches!(
        index.commit(2),
        Err(KeywordError::CheckpointBackwards {
            committed: 3,
            requested: 2
        })
    ));
    index.commit(3).unwrap();
    assert_eq!(index.committed_seq(), 3);
}

#[test]
fn delete_takes_effect_at_commit() {
    // given
    let a = team("a");
    let mut index = index_with(&a, &["keep this", "drop this"]);
    // when
    index.delete(2).unwrap();
    index.delete(99).unwrap(); // absent: not an error
    // then: still visible until the commit
    assert_eq!(
        index
            .search("this", from_ref(&a), &any(), 10)
            .unwrap()
            .len(),
        2
    );
    index.commit(3).unwrap();
    assert_eq!(
        seqs(&index.search("this", &[a], &any(), 10).unwrap()),
        vec![1]
    );
    assert_eq!(index.doc_count(), 1);
}

#[test]
fn clear_empties_the_index_and_resets_the_checkpoint() {
    // given: committed memories and a staged one
    let dir = tempfile::tempdir().unwrap();
    let a = team("a");
    {
        let mut index = KeywordIndex::open(dir.path()).unwrap();
        index.add(&meta(1, &a), "old world").unwrap();
        index.commit(1).unwrap();
        index.add(&meta(2, &a), "staged world").unwrap();
        // when
        index.clear().unwrap();
        // then
        assert_eq!(index.committed_seq(), 0);
        assert_eq!(index.doc_count(), 0);
        assert!(
            index
                .search("world", from_ref(&a), &any(), 10)
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            index.state_hash().unwrap(),
            KeywordIndex::in_ram().unwrap().state_hash().unwrap()
        );
        // and a rebuild from sequence 1 works
        index.add(&meta(1, &a), "new world").unwrap();
        index.commit(1).unwrap();
    }
    let index = KeywordIndex::open(dir.path()).unwrap();
    assert_eq!(index.committed_seq(), 1);
    assert_eq!(
        seqs(&index.search("world", from_ref(&a), &any(), 10).unwrap()),
        vec![1]
    );
    assert!(index.search("old", &[a], &any(), 10).unwrap().is_empty());
}

#[test]
fn readers_see_a_commit_as_soon_as_it_returns() {
    let a = team("a");
    let mut index = KeywordIndex::in_ram().unwrap();
    let reader: KeywordReader = index.reader();
    index.add(&meta(1, &a), "fresh write").unwrap();
    assert_eq!(reader.committed_seq(), 0);
    assert_eq!(reader.tail_len(), 1);
    index.commit(1).unwrap();
    assert_eq!(reader.committed_seq(), 1);
    assert_eq!(reader.tail_len(), 0, "the commit holds what the tail held");
    assert_eq!(
        seqs(&reader.search("fresh", &[a], &any(), 10).unwrap()),
        vec![1]
    );
}

/// Scores by sequence, rounded so that two float sums of the same terms compare equal.
fn scores(hits: &[Hit]) -> Vec<(Seq, i64)> {
    hits.iter()
        .map(|h| (h.seq, (f64::from(h.score) * 1e4).round() as i64))
        .collect()
}

#[test]
fn an_added_memory_is_found_before_its_commit_at_the_score_the_commit_gives_it() {
    // Given committed memories of two scopes
    let (a, b) = (team("a"), team("b"));
    let mut index = KeywordIndex::in_ram().unwrap();
    let reader = index.reader();
    let committed = [
        "the deploy failed on friday",
        "deploys run on tuesdays",
        "the cache warms at start",
    ];
    for (i, text) in committed.iter().enumerate() {
        index.add(&meta(i as u64 + 1, &a), text).unwrap();
    }
    index
        .add(&meta(4, &b), "deploy keys rotate monthly")
        .unwrap();
    index.commit(4).unwrap();

    // When more are added, not yet committed (one rare word, one common)
    index
        .add(
            &meta(5, &a),
            "the friday deploy failed again, deploy rolled back",
        )
        .unwrap();
    index.add(&meta(6, &b), "zeppelin maintenance").unwrap();
    let before = reader
        .search("deploy failed friday", from_ref(&a), &any(), 10)
        .unwrap();
    let rare_before = reader.search("zeppelin", from_ref(&b), &any(), 10).unwrap();

    // Then they are found at once, ranked among the committed ones, only in their scope
    assert!(seqs(&before).contains(&5), "{before:?}");
    assert!(!seqs(&before).contains(&6));
    assert_eq!(seqs(&rare_before), vec![6]);
    // And the commit changes no score and no rank: the tail was scored as the commit scores
    index.commit(6).unwrap();
    let after = reader
        .search("deploy failed friday", from_ref(&a), &any(), 10)
        .unwrap();
    assert_eq!(scores(&before), scores(&after));
    assert_eq!(
        scores(&rare_before),
        scores(&reader.search("zeppelin", &[b], &any(), 10).unwrap())
    );
}

#[test]
fn a_memory_changed_or_removed_before_its_commit_is_searched_as_it_is_now() {
    let (a, b) = (team("a"), team("b"));
    let mut index = index_with(&a, &["the api key is in vault", "vault opens at nine"]);
    // A committed memory added again with a lower confidence: one hit, filtered by the new one
    let mut lowered = meta(1, &a);
    lowered.confidence = 0.25;
    index.add(&lowered, "the api key is in vault").unwrap();
    let trusted = MemoryFilter {
        min_confidence: Some(0.5),
        ..MemoryFilter::default()
    };
    assert_eq!(
        seqs(&index.search("vault", from_ref(&a), &any(), 10).unwrap())
            .iter()
            .filter(|s| **s == 1)
            .count(),
        1
    );
    assert_eq!(
        seqs(&index.search("vault", from_ref(&a), &trusted, 10).unwrap()),
        vec![2]
    );
    // A memory added and deleted before the commit is gone at once
    index
        .add(&meta(3, &a), "vault moved to the basement")
        .unwrap();
    index.delete(3).unwrap();
    assert!(!seqs(&index.search("basement", from_ref(&a), &any(), 10).unwrap()).contains(&3));
    // And an erased scope's uncommitted memories go with it
    index.add(&meta(4, &b), "vault of scope b").unwrap();
    index.delete_scope(&b).unwrap();
    assert!(
        index
            .search("vault", from_ref(&b), &any(), 10)
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        index.reader().tail_len(),
        1,
        "only the lowered memory is left uncommitted"
    );
}

fn world() -> Vec<(MemoryMeta, String)> {
    let (a, b) = (team("a"), team("b"));
    (1..=30u64)
        .map(|seq| {
            let mut m = meta(seq, if seq % 3 == 0 { &b } else { &a });
            m.tags = vec![format!("t{}", seq % 4)];
            m.importance = (seq % 7) as f64 / 7.0;
            (m, format!("memory number {seq} about topic {}", seq % 5))
        })
        .collect()
}

#[test]
fn state_hash_depends_on_content_not_on_how_it_was_committed() {
    let world = world();
    // given: the same memories, all in one commit
    let mut one = KeywordIndex::in_ram().unwrap();
    for (m, text) in &world {
        one.add(m, text).unwrap();
    }
    one.commit(30).unwrap();

    // and in many small commits, in another order, with detours that end up the same
    let dir = tempfile::tempdir().unwrap();
    let mut many = KeywordIndex::open(dir.path()).unwrap();
    many.add(&world[4].0, "a draft later replaced").unwrap();
    many.add(&meta(99, &team("a")), "a memory later deleted")
        .unwrap();
    many.commit(1).unwrap();
    for (i, chunk) in world.chunks(7).rev().enumerate() {
        for (m, text) in chunk {
            many.add(m, text).unwrap();
        }
        many.commit(2 + i as Seq).unwrap();
    }
    many.delete(99).unwrap();
    many.commit(30).unwrap();
    drop(many);
    let many = KeywordIndex::open(dir.path()).unwrap();

    // then
    assert_eq!(one.doc_count(), many.doc_count());
    assert_eq!(one.state_hash().unwrap(), many.state_hash().unwrap());
}

#[test]
fn state_hash_differs_for_different_content() {
    let hash_of = |world: &[(MemoryMeta, String)]| {
        let mut index = KeywordIndex::in_ram().unwrap();
        for (m, text) in world {
            index.add(m, text).unwrap();
        }
        index.commit(30).unwrap();
        index.state_hash().unwrap()
    };
    let base = world();
    let original = hash_of(&base);
    assert_eq!(hash_of(&base), original);

    let mut variants: Vec<Vec<(MemoryMeta, String)>> = Vec::new();
    let mut change = |edit: &dyn Fn(&mut (MemoryMeta, String))| {
        let mut world = base.clone();
        edit(&mut world[10]);
        variants.push(world);
    };
    change(&|(_, text)| text.push('!'));
    change(&|(m, _)| m.seq = 100);
    change(&|(m, _)| m.scope = team("c"));
    change(&|(m, _)| m.layer = Layer::Semantic);
    change(&|(m, _)| m.kind = EventKind::Action);
    change(&|(m, _)| m.tags.push("extra".into()));
    change(&|(m, _)| m.tags = vec!["t".into(), "2".into()]);
    change(&|(m, _)| m.occurred_at += Duration::nanoseconds(1));
    change(&|(m, _)| m.importance = 0.9);
    change(&|(m, _)| m.confidence = 0.5);
    let mut fewer = base.clone();
    fewer.pop();
    variants.push(fewer);

    for (i, variant) in variants.iter().enumerate() {
        assert_ne!(hash_of(variant), original, "variant {i}");
    }
}

#[test]
fn index_and_reader_can_cross_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<KeywordIndex>();
    assert_send_sync::<KeywordReader>();
}

/// Not a test of speed: prints indexing throughput for the record.
/// `cargo test --release -p engram-keyword --test keyword -- --ignored --nocapture throughput`
/// (`KEYWORD_BENCH_BATCH=n` sets the memories per commit, 1000 by default).
#[test]
#[ignore]
fn throughput() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = KeywordIndex::open(dir.path()).unwrap();
    let words = [
        "deploy",
        "database",
        "migration",
        "failed",
        "cache",
        "latency",
        "user",
        "prefers",
        "dark",
        "mode",
        "retry",
        "timeout",
        "agent",
        "memory",
        "billing",
        "service",
        "incident",
        "rollback",
        "release",
        "metrics",
        "alert",
        "queue",
        "worker",
        "schema",
    ];
    let scopes: Vec<ScopeKey> = (0..50).map(|i| team(&format!("team-{i}"))).collect();
    let total: u64 = 100_000;
    // Memories per commit; each commit is an fsync and a new segment.
    let batch: u64 = std::env::var("KEYWORD_BENCH_BATCH")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(1_000);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let texts: Vec<String> = (0..total)
        .map(|_| {
            let len = 12 + next() % 30;
            (0..len)
                .map(|_| words[(next() % words.len() as u64) as usize])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let metas: Vec<MemoryMeta> = (1..=total)
        .map(|seq| meta(seq, &scopes[(seq % 50) as usize]))
        .collect();

    let started = std::time::Instant::now();
    for (i, (m, text)) in metas.iter().zip(&texts).enumerate() {
        index.add(m, text).unwrap();
        if (i as u64 + 1).is_multiple_of(batch) {
            index.commit(i as u64 + 1).unwrap();
        }
    }
    let elapsed = started.elapsed();
    println!(
        "indexed {total} memories (~27 words) in commits of {batch}: {:.2}s, {:.0} memories/s",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );

    let started = std::time::Instant::now();
    let queries = 1_000;
    for i in 0..queries {
        let q = format!(
            "{} {} {}",
            words[i % 24],
            words[(i * 7) % 24],
            words[(i * 13) % 24]
        );
        index
            .search(&q, from_ref(&scopes[i % 50]), &any(), 10)
            .unwrap();
    }
    let elapsed = started.elapsed();
    println!(
        "{queries} three-term searches over {total}: {:.0} µs each",
        elapsed.as_secs_f64() * 1e6 / queries as f64
    );
    let started = std::time::Instant::now();
    index.state_hash().unwrap();
    println!(
        "state_hash over {total}: {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
}

/// A query searches at most `MAX_QUERY_TERMS` distinct terms (the first in sorted order):
/// thousands of words cost no more than that, and the search still answers.
#[test]
fn a_query_of_thousands_of_words_searches_only_the_first_terms() {
    let scope = team("core");
    // Terms w0000 .. w2999 sort by their number; memory 1 holds one inside the cap, memory 2
    // one past it.
    let inside = "w0010";
    let outside = format!("w{:04}", engram_keyword::MAX_QUERY_TERMS + 10);
    let index = index_with(&scope, &[inside, outside.as_str()]);
    let query: String = (0..3_000).map(|i| format!("w{i:04} ")).collect();
    let hits = index.search(&query, from_ref(&scope), &any(), 10).unwrap();
    assert_eq!(seqs(&hits), vec![1], "{hits:?}");
    // Each term on its own is found: the cap, not the index, left memory 2 out.
    let alone = index
        .search(&outside, from_ref(&scope), &any(), 10)
        .unwrap();
    assert_eq!(seqs(&alone), vec![2]);
}

#[test]
fn an_index_shipped_as_files_opens_elsewhere_with_the_importers_checkpoint() {
    // given: an exporting index with a delete, committed; and an importing one holding
    // other memories
    let (from, to) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = team("a");
    let mut source = KeywordIndex::open(from.path()).unwrap();
    for seq in 1..=40 {
        source
            .add(&meta(seq, &a), &format!("shipped memory number {seq}"))
            .unwrap();
    }
    source.commit(40).unwrap();
    source.delete(7).unwrap();
    source.commit_with_note(41, "exporter's note").unwrap();
    let files = source.handle().committed_files().unwrap();
    assert!(files.files.iter().any(|f| f.name.ends_with(".del")));
    {
        let mut old = KeywordIndex::open(to.path()).unwrap();
        old.add(&meta(1, &a), "an older memory").unwrap();
        old.commit(1).unwrap();
        old.close().unwrap();
    }
    let old_files: BTreeSet<_> = std::fs::read_dir(to.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();

    // when: the files are installed there with the importer's checkpoint and note
    engram_keyword::install_files(to.path(), &files, 41, "importer's note").unwrap();
    let imported = KeywordIndex::open(to.path()).unwrap();
    imported.collect_garbage().unwrap();

    // then: it answers as the exporter does, carries the importer's checkpoint, and the
    // replaced commit's segments are gone
    assert_eq!(imported.committed_seq(), 41);
    assert_eq!(imported.committed_note(), Some("importer's note"));
    assert_eq!(imported.doc_count(), 39);
    assert_eq!(imported.state_hash().unwrap(), source.state_hash().unwrap());
    let hits = |index: &KeywordIndex| {
        seqs(
            &index
                .search("shipped number", from_ref(&a), &any(), 50)
                .unwrap(),
        )
    };
    assert_eq!(hits(&imported), hits(&source));
    assert!(!hits(&imported).contains(&7));
    let left: BTreeSet<_> = std::fs::read_dir(to.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let segment = |n: &std::ffi::OsString| {
        n.to_string_lossy().contains('.')
            && !n.to_string_lossy().starts_with('.')
            && n != "meta.json"
    };
    assert!(
        old_files
            .iter()
            .filter(|n| segment(n))
            .all(|n| !left.contains(n)),
        "old segments left: {old_files:?} {left:?}"
    );

    // and installing the same files again (a replica importing its own snapshot) works
    drop(imported);
    engram_keyword::install_files(to.path(), &files, 42, "again").unwrap();
    assert_eq!(KeywordIndex::open(to.path()).unwrap().doc_count(), 39);
}

#[test]
fn shipped_files_that_would_escape_or_differ_are_refused_and_change_nothing() {
    let (from, to) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = team("a");
    let mut source = KeywordIndex::open(from.path()).unwrap();
    source.add(&meta(1, &a), "shipped memory").unwrap();
    source.commit(1).unwrap();
    let files = source.handle().committed_files().unwrap();
    {
        let mut kept = KeywordIndex::open(to.path()).unwrap();
        kept.add(&meta(1, &a), "kept memory").unwrap();
        kept.commit(1).unwrap();
    }
    let mut escaping = files.clone();
    escaping.files[0].name = "../outside.idx".into();
    let mut meta_named = files.clone();
    meta_named.files[0].name = "meta.json".into();
    let mut twice = files.clone();
    twice.files.push(files.files[0].clone());
    for bad in [escaping, meta_named, twice] {
        assert!(engram_keyword::install_files(to.path(), &bad, 2, "bad").is_err());
    }
    {
        let kept = KeywordIndex::open(to.path()).unwrap();
        assert_eq!(kept.committed_seq(), 1);
        assert_eq!(
            seqs(&kept.search("kept", from_ref(&a), &any(), 5).unwrap()),
            vec![1]
        );
    }
    // A file of the same name with other content.
    engram_keyword::install_files(to.path(), &files, 2, "ok").unwrap();
    let mut differing = files.clone();
    differing.files[0].bytes.push(0);
    assert!(engram_keyword::install_files(to.path(), &differing, 3, "bad").is_err());
    let index = KeywordIndex::open(to.path()).unwrap();
    assert_eq!(index.committed_seq(), 2);
    assert!(!from.path().parent().unwrap().join("outside.idx").exists());
}

#[test]
fn a_scopes_scores_do_not_depend_on_the_other_scopes_its_index_holds() {
    // Given one tenant's scope alone in an index
    let a = scope("acme", ScopeKind::Task, "t1");
    let texts = [
        "the deploy failed on friday",
        "deploys run on tuesdays after the review",
        "the cache warms at start",
        "friday is the quiet day",
    ];
    let alone = index_with(&a, &texts);
    let query = "deploy failed friday cache";
    let expected = scores(&alone.search(query, from_ref(&a), &any(), 10).unwrap());
    assert_eq!(expected.len(), 4, "{expected:?}");

    // When the same scope shares its index (its partition) with another tenant's, whose
    // memories use the query's words at other rates and lengths, committed and not
    let b = scope("globex", ScopeKind::Task, "t1");
    let mut shared = KeywordIndex::in_ram().unwrap();
    for (i, text) in texts.iter().enumerate() {
        shared.add(&meta(i as Seq + 1, &a), text).unwrap();
    }
    for seq in 5..40 {
        let text = if seq % 2 == 0 {
            "deploy deploy deploy failed"
        } else {
            "friday cache friday cache friday cache with many more words than the others hold"
        };
        shared.add(&meta(seq, &b), text).unwrap();
    }
    shared.commit(39).unwrap();
    let committed = scores(&shared.search(query, from_ref(&a), &any(), 10).unwrap());
    shared
        .add(&meta(40, &b), "deploy failed friday cache deploy")
        .unwrap();
    let with_tail = scores(&shared.search(query, from_ref(&a), &any(), 10).unwrap());

    // Then the scope's memories rank and score exactly as when alone
    assert_eq!(committed, expected);
    assert_eq!(with_tail, expected);
    // And the other tenant's memories are all still found in theirs
    assert_eq!(
        shared
            .search(query, from_ref(&b), &any(), 50)
            .unwrap()
            .len(),
        36
    );
}

#[test]
fn a_questions_function_words_do_not_match_and_a_query_of_nothing_else_keeps_them() {
    // Given a memory made of function words and one about the thing asked
    let a = team("a");
    let index = index_with(
        &a,
        &[
            "what did you do there, and when did you do it?",
            "the deploy failed",
            "to be or not to be",
        ],
    );

    // When a question asks about the deploy in function words
    let hits = index
        .search(
            "what did the deploy do when it was there",
            from_ref(&a),
            &any(),
            10,
        )
        .unwrap();

    // Then only the memory about the deploy matches
    assert_eq!(seqs(&hits), vec![2]);
    // And a query of function words only still finds them
    let hits = index
        .search("to be or not to be", from_ref(&a), &any(), 10)
        .unwrap();
    assert_eq!(seqs(&hits)[0], 3, "{hits:?}");
}
