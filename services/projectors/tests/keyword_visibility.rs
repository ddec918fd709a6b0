//! The keyword projector never reports a visible sequence its search could not see: every
//! answer's `visible_seq` is covered by the commit its searcher read, while commits land
//! concurrently with the searches.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use engram_bus::Bus;
use engram_embed::EmbedderConfig;
use engram_memory::proto::{Consistency, SearchRequest, SearchResponse, partition_subject};
use engram_memory::{MemoryFilter, ScopeKey, Seq};
use engram_projectors::{ProjectorName, ProjectorsConfig};
use engram_testkit::{TestNats, event};

const EVENTS: usize = 600;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_search_sees_all_it_reports_visible_under_concurrent_commits() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    // Given the keyword projector alone, committing as often as it can at the tail
    let config = ProjectorsConfig {
        keyword_tail_commit_gap: Duration::ZERO,
        keyword_commit_interval: Duration::ZERO,
        ..keyword_only()
    };
    let (running, stop) = start(&nats, &config, dir.path()).await;

    let scope = ScopeKey::of(&event("acme", "t1", "x"));
    // The instance of the scope's partition holds it.
    let partition = scope.partition(bus.config().stream.partitions);
    let ledger = |client: async_nats::Client| async move {
        engram_rpc::call::<_, engram_projectors::ProjectorLedger>(
            &client,
            &partition_subject("keyword", "ledger", partition),
            &Consistency::default(),
            Duration::from_secs(5),
        )
        .await
    };
    let request = SearchRequest {
        scopes: vec![scope],
        query: "needle".into(),
        vector: None,
        k: EVENTS + 100,
        filter: MemoryFilter::default(),
        consistency: Consistency::default(),
        score_also: Vec::new(),
        rest: 0,
    };
    let search = move |client: async_nats::Client, request: SearchRequest| async move {
        engram_rpc::call::<_, SearchResponse>(
            &client,
            &partition_subject("keyword", "search", partition),
            &request,
            Duration::from_secs(10),
        )
        .await
    };
    engram_testkit::wait_until("the keyword index to open", Duration::from_secs(30), || {
        let (client, request) = (bus.client().clone(), request.clone());
        async move { search(client, request).await.is_ok() }
    })
    .await;

    // When events arrive a few at a time (a commit each) while searches run back to back
    let done = Arc::new(AtomicBool::new(false));
    // The highest visible sequence an answer has reported so far.
    let answered_visible = Arc::new(AtomicU64::new(0));
    let mut searchers = Vec::new();
    for _ in 0..3 {
        let (client, done, request) = (bus.client().clone(), done.clone(), request.clone());
        let answered_visible = answered_visible.clone();
        searchers.push(tokio::spawn(async move {
            let mut answers: Vec<(Seq, Vec<Seq>)> = Vec::new();
            while !done.load(Ordering::SeqCst) {
                let answer = search(client.clone(), request.clone()).await.unwrap();
                answers.push((
                    answer.visible_seq,
                    answer.hits.iter().map(|h| h.hit.seq).collect(),
                ));
                answered_visible.fetch_max(answer.visible_seq, Ordering::SeqCst);
            }
            answers
        }));
    }
    let mut appended: Vec<Seq> = Vec::with_capacity(EVENTS);
    let batches = EVENTS / 3;
    for chunk in 0..batches {
        let events: Vec<_> = (0..3)
            .map(|i| event("acme", "t1", &format!("needle number {}", chunk * 3 + i)))
            .collect();
        for receipt in bus.append_batch(&events, 8).await {
            appended.push(receipt.unwrap().seq);
        }
        // The next batch waits for an answer that reports this one visible, however slow
        // the machine: so every batch but the last is searched at its own commit, while
        // the searchers keep overlapping the commits as they land.
        let batch_last = *appended.last().unwrap();
        engram_testkit::wait_until(
            &format!("a search to report seq {batch_last} visible"),
            Duration::from_secs(30),
            || {
                let answered_visible = answered_visible.clone();
                async move { answered_visible.load(Ordering::SeqCst) >= batch_last }
            },
        )
        .await;
    }
    let last = *appended.iter().max().unwrap();
    engram_testkit::wait_until("all events visible", Duration::from_secs(60), || {
        let client = bus.client().clone();
        async move { ledger(client).await.is_ok_and(|l| l.visible_seq >= last) }
    })
    .await;
    done.store(true, Ordering::SeqCst);

    // Then every answer holds every memory up to the sequence it reported visible
    let mut answers = Vec::new();
    for s in searchers {
        answers.extend(s.await.unwrap());
    }
    let moving = answers
        .iter()
        .filter(|(visible, _)| *visible > 0 && *visible < last)
        .count();
    eprintln!(
        "{} searches, {moving} of them while commits were landing",
        answers.len()
    );
    // Each batch but the last was answered at its own visible sequence, before the next
    // batch was appended: a count the schedule fixes.
    assert!(
        moving >= batches - 1,
        "{moving} searches answered between commits, fewer than the {} batches before the last",
        batches - 1
    );
    for (visible, hits) in &answers {
        let missing: Vec<&Seq> = appended
            .iter()
            .filter(|seq| **seq <= *visible && !hits.contains(seq))
            .collect();
        assert!(
            missing.is_empty(),
            "an answer reported seq {visible} visible but lacked {} memories at or below it, e.g. {:?}",
            missing.len(),
            missing.first()
        );
    }
    stop.cancel();
    running.join().await.unwrap();
}

/// Starts `config`'s projectors on `nats` with their state in `dir`; cancel the token to stop.
async fn start(
    nats: &TestNats,
    config: &ProjectorsConfig,
    dir: &std::path::Path,
) -> (
    engram_projectors::RunningProjectors,
    tokio_util::sync::CancellationToken,
) {
    let stop = tokio_util::sync::CancellationToken::new();
    let bus_config = nats.bus_config();
    let running = engram_projectors::start(
        config,
        dir,
        move |_, _| Bus::connect(bus_config.clone()),
        stop.clone(),
    )
    .await
    .unwrap();
    (running, stop)
}

/// The keyword projector alone, with no embedder to load.
fn keyword_only() -> ProjectorsConfig {
    ProjectorsConfig {
        run: vec![ProjectorName::KEYWORD],
        embedder: EmbedderConfig::ClientSupplied {
            model: "none".into(),
            dim: 4,
        },
        embed_cache_memory_mb: 4,
        embed_cache_disk_mb: 8,
        ..ProjectorsConfig::default()
    }
}

/// The keyword projector alone, with commits an hour apart.
fn rarely_committing() -> ProjectorsConfig {
    ProjectorsConfig {
        keyword_tail_commit_gap: Duration::from_secs(3600),
        keyword_commit_interval: Duration::from_secs(3600),
        checkpoint_interval: Duration::from_secs(3600),
        checkpoint_every: u64::MAX,
        ..keyword_only()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_found_as_soon_as_it_is_applied_long_before_its_commit() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let config = rarely_committing();
    let (running, stop) = start(&nats, &config, dir.path()).await;
    let scope = ScopeKey::of(&event("acme", "t1", "x"));
    let partition = scope.partition(bus.config().stream.partitions);

    // Given a first write, searched with its token (so the index is open and has caught up)
    let mut appended = Vec::new();
    for text in ["the first needle", "a second needle", "the third needle"] {
        let seq = bus
            .append(&event("acme", "t1", text), Default::default())
            .await
            .unwrap()
            .seq;
        appended.push(seq);
        // When each is searched with its own token
        let request = SearchRequest {
            scopes: vec![scope.clone()],
            query: "needle".into(),
            vector: None,
            k: 10,
            filter: MemoryFilter::default(),
            consistency: Consistency {
                min_seq: Some(seq),
                wait_ms: Some(20_000),
            },
            score_also: Vec::new(),
            rest: 0,
        };
        let answer: SearchResponse = engram_rpc::call(
            bus.client(),
            &partition_subject("keyword", "search", partition),
            &request,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        // Then it is found, with all before it, while no commit has been made: from the tail
        let found: Vec<Seq> = answer.hits.iter().map(|h| h.hit.seq).collect();
        for s in &appended {
            assert!(found.contains(s), "seq {s} missing from {found:?}");
        }
        assert!(answer.visible_seq >= seq);
    }
    // The index's last commit (its payload names the sequence it holds) is older than every
    // write found: each came from the tail.
    let meta = std::fs::read_to_string(
        engram_projectors::partition_dir(dir.path(), partition)
            .join("keyword")
            .join("meta.json"),
    )
    .unwrap();
    let committed: Seq = meta
        .split("applied_seq=")
        .nth(1)
        .map(|rest| {
            rest.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap()
        })
        .unwrap_or(0);
    assert!(
        committed < appended[0],
        "the index committed seq {committed}, so the writes may have come from a commit"
    );
    stop.cancel();
    running.join().await.unwrap();
}
