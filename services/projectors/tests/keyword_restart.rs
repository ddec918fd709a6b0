//! The keyword model keeps the ids of forgotten memories across a restart: a late retry of
//! a forgotten memory (outside the stream's duplicate window) is not indexed again, and a
//! crash between the ids log and the commit loses nothing the commit covered.

use engram_memory::proto::{Consistency, SearchRequest};
use engram_memory::{MemoryFilter, ScopeKey};
use engram_projection_runtime::{ApplyLedger, Projection};
use engram_projectors::keyword::KeywordProjection;
use engram_schema::{Envelope, EventKind, Layer};
use engram_testkit::{event, stored};

fn forget(target: &Envelope) -> Envelope {
    let mut e = event("acme", "t1", "forget it");
    e.kind = EventKind::Forgotten;
    e.layer = Layer::Working;
    e.content.data = Some(serde_json::json!({"event_ids": [target.event_id.as_str()]}));
    e
}

async fn opened(dir: &std::path::Path) -> (KeywordProjection, ApplyLedger) {
    let keyword = KeywordProjection::new(dir);
    let ledger = keyword.restore().await.unwrap();
    (keyword, ledger)
}

async fn apply(keyword: &KeywordProjection, events: &[Envelope], first_seq: u64) {
    let batch = stored(events, first_seq);
    assert!(keyword.apply(&batch).await.unwrap().is_empty());
    let ledger = ApplyLedger {
        seq: batch.last().unwrap().seq,
        ..ApplyLedger::default()
    };
    keyword.publish(&ledger).await.unwrap();
}

async fn found(keyword: &KeywordProjection, query: &str) -> Vec<String> {
    let request = SearchRequest {
        scopes: vec![ScopeKey::of(&event("acme", "t1", "x"))],
        query: query.into(),
        vector: None,
        k: 10,
        filter: MemoryFilter::default(),
        consistency: Consistency::default(),
        score_also: Vec::new(),
        rest: 0,
    };
    let hits = keyword.search(&request).await.unwrap().hits;
    hits.into_iter().map(|h| h.text).collect()
}

#[tokio::test]
async fn a_forgotten_memory_retried_after_a_restart_is_not_indexed_again() {
    let dir = tempfile::tempdir().unwrap();
    let secret = event("acme", "t1", "the staging password is hunter2");
    let kept = event("acme", "t1", "the staging host is db-3");
    {
        // Given a memory written, then forgotten, each committed.
        let (keyword, _) = opened(dir.path()).await;
        apply(&keyword, &[secret.clone(), kept.clone()], 1).await;
        apply(&keyword, &[forget(&secret)], 3).await;
        assert_eq!(
            found(&keyword, "staging").await,
            vec![kept.content.text.clone()]
        );
    }
    // When the model restarts and the forgotten memory arrives again, late.
    let (keyword, ledger) = opened(dir.path()).await;
    assert_eq!(ledger.seq, 3);
    apply(&keyword, std::slice::from_ref(&secret), 4).await;
    // Then it stays forgotten.
    assert_eq!(
        found(&keyword, "staging").await,
        vec![kept.content.text.clone()]
    );
    // And the same holds after a further restart that had nothing new to commit.
    drop(keyword);
    let (keyword, _) = opened(dir.path()).await;
    apply(&keyword, std::slice::from_ref(&secret), 5).await;
    assert_eq!(found(&keyword, "staging").await, vec![kept.content.text]);
}

#[tokio::test]
async fn ids_logged_for_a_commit_a_crash_prevented_are_cut_off_at_restart() {
    let dir = tempfile::tempdir().unwrap();
    let early = event("acme", "t1", "the early note about staging");
    let next = event("acme", "t1", "the next note about staging");
    {
        let (keyword, _) = opened(dir.path()).await;
        apply(&keyword, std::slice::from_ref(&early), 1).await;
    }
    // Given a log that holds an id no commit covers, as a process that logged a forgetting
    // and died before its commit leaves it.
    let log = dir.path().join("keyword-ids.log");
    let mut text = std::fs::read_to_string(&log).unwrap();
    assert!(text.starts_with("g "), "{text:?}");
    text.push_str(&format!("f {}\n", next.event_id.as_str()));
    std::fs::write(&log, text).unwrap();
    // When the model restarts, the uncommitted tail is cut off, not taken for a forgotten
    // id: the memory it named is indexed when it comes.
    let (keyword, ledger) = opened(dir.path()).await;
    assert_eq!(ledger.seq, 1);
    apply(&keyword, std::slice::from_ref(&next), 2).await;
    let texts = found(&keyword, "staging").await;
    assert_eq!(texts.len(), 2, "{texts:?}");
}

#[tokio::test]
async fn a_log_the_commit_does_not_name_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let note = event("acme", "t1", "a note");
    {
        let (keyword, _) = opened(dir.path()).await;
        apply(&keyword, std::slice::from_ref(&note), 1).await;
        apply(&keyword, &[forget(&note)], 2).await;
    }
    // Given the log replaced by another one (another generation).
    let log = dir.path().join("keyword-ids.log");
    let text = std::fs::read_to_string(&log).unwrap();
    let body = text.split_once('\n').unwrap().1;
    std::fs::write(&log, format!("g another\n{body}")).unwrap();
    // Then the restart refuses it and says how to recover.
    let keyword = KeywordProjection::new(dir.path());
    let err = keyword.restore().await.unwrap_err().to_string();
    assert!(err.contains("engram rebuild keyword"), "{err}");
}
