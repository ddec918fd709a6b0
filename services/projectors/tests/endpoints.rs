//! The projector services' own endpoints against a real nats-server: `ledger` and `status`
//! answer for every projector, and each counts every event it applied, ignored ones included;
//! each serves the ops the read-model table names for it.

use std::time::Duration;

use engram_bus::Bus;
use engram_embed::EmbedderConfig;
use engram_fixtures::HashEmbedder;
use engram_keyword::KeywordIndex;
use engram_memory::Seq;
use engram_memory::proto::{Consistency, ErrorCode, partition_subject, read_models};
use engram_projection_runtime::{ApplyLedger, Projection, ProjectionError, ledger_entry};
use engram_projectors::{ProjectorLedger, ProjectorName, ProjectorStatus, ProjectorsConfig};
use engram_schema::{Embedding, Envelope, EventKind, Layer};
use engram_testkit::{TestNats, event};

const DIM: usize = 16;

fn config() -> ProjectorsConfig {
    ProjectorsConfig {
        embedder: EmbedderConfig::ClientSupplied {
            model: format!("hash-{DIM}"),
            dim: DIM,
        },
        checkpoint_interval: Duration::from_millis(200),
        embed_cache_memory_mb: 4,
        embed_cache_disk_mb: 8,
        ..ProjectorsConfig::default()
    }
}

/// Text memories with client-supplied vectors, and a fact, which the text projectors ignore.
fn events() -> Vec<Envelope> {
    let embedder = HashEmbedder::new(DIM);
    let mut out: Vec<Envelope> = (0..12)
        .map(|i| event("acme", "t1", &format!("memory {i} about ledgers")))
        .collect();
    let mut fact = event("acme", "t1", "the sky is blue");
    fact.layer = Layer::Semantic;
    fact.kind = EventKind::FactAsserted;
    fact.content.data =
        Some(serde_json::json!({"subject": "sky", "predicate": "colour", "object": "blue"}));
    out.insert(5, fact);
    for e in &mut out {
        e.embedding = Some(Embedding {
            model: format!("hash-{DIM}"),
            vector: embedder.embed_one(&e.content.text),
        });
    }
    out
}

#[tokio::test]
async fn ledger_and_status_report_what_each_projector_applied() {
    // Given the four projectors, and events already in the stream
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let events = events();
    let mut expected = ApplyLedger::default();
    for (event, receipt) in events.iter().zip(bus.append_batch(&events, 64).await) {
        let seq: Seq = receipt.unwrap().seq;
        expected.seq = seq;
        expected.events += 1;
        expected.digest = expected
            .digest
            .wrapping_add(ledger_entry(seq, event.event_id.as_str()));
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let bus_config = nats.bus_config();
    let running = engram_projectors::start(
        &config(),
        dir.path(),
        move |_, _| Bus::connect(bus_config.clone()),
        stop.clone(),
    )
    .await
    .unwrap();

    // When each is asked for its ledger once the last event is visible
    let wait = Consistency {
        min_seq: Some(expected.seq),
        wait_ms: Some(10_000),
    };
    let partitions = bus.config().stream.partitions;
    for name in ProjectorName::all() {
        let answer: ProjectorLedger = engram_projectors::ledger_of(
            bus.client(),
            name.as_str(),
            partitions,
            &wait,
            Duration::from_secs(15),
        )
        .await
        .unwrap_or_else(|e| panic!("{name} ledger: {e}"));

        // Then its partitions together count every event, the fact included, and all of
        // them read at the last one (those that hold none of these events too)
        assert_eq!(answer.projector, name.as_str());
        assert_eq!(answer.visible_seq, expected.seq, "{name}");
        assert_eq!(answer.ledger, expected, "{name}");

        // And only the scope's partition applied them
        let parts: Vec<ProjectorLedger> = engram_projectors::ask_partitions(
            bus.client(),
            name.as_str(),
            "ledger",
            partitions,
            &Consistency::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let holder = engram_memory::ScopeKey::of(&events[0]).partition(partitions);
        for part in &parts {
            let p = part.partition.expect("an instance names its partition");
            let applied = if p == holder { expected.events } else { 0 };
            assert_eq!(part.ledger.events, applied, "{name} partition {p}");
        }

        // And status carries the same ledger beside its state hash
        let status: ProjectorStatus = engram_projectors::status_of(
            bus.client(),
            name.as_str(),
            partitions,
            &Consistency::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|e| panic!("{name} status: {e}"));
        assert_eq!(status.ledger, expected, "{name}");
        assert_eq!(status.state_hash.len(), 64, "{name}");
    }

    // And each serves the ops its row of the read-model table names, beside the ones every
    // projector serves: no op missing (the vector model's neighbours), none unlisted
    let mut served: std::collections::BTreeMap<&str, std::collections::BTreeSet<String>> =
        std::collections::BTreeMap::new();
    for name in ProjectorName::all() {
        let info = bus
            .client()
            .request(format!("$SRV.INFO.engram-{name}"), Default::default())
            .await
            .unwrap_or_else(|e| panic!("{name} service info: {e}"));
        let info: serde_json::Value = serde_json::from_slice(&info.payload).unwrap();
        let prefix = format!("engram.p.{name}.");
        // Each op once per partition: `engram.p.<name>.<op>.<partition>`.
        let mut per_op: std::collections::BTreeMap<String, std::collections::BTreeSet<u32>> =
            Default::default();
        for e in info["endpoints"]
            .as_array()
            .unwrap_or_else(|| panic!("{name} lists no endpoints: {info}"))
        {
            let subject = e["subject"].as_str().unwrap_or_default();
            let (op, p) = subject
                .strip_prefix(&prefix)
                .and_then(|rest| rest.rsplit_once('.'))
                .unwrap_or_else(|| panic!("{name} serves {subject}"));
            per_op.entry(op.to_owned()).or_default().insert(
                p.parse()
                    .unwrap_or_else(|_| panic!("{name} serves {subject}")),
            );
        }
        for (op, parts) in &per_op {
            assert_eq!(
                parts.iter().copied().collect::<Vec<u32>>(),
                (0..partitions).collect::<Vec<u32>>(),
                "{name} {op}: every partition, once"
            );
        }
        served.insert(name.as_str(), per_op.into_keys().collect());
    }
    let every: std::collections::BTreeSet<String> = served
        .values()
        .skip(1)
        .fold(served.values().next().unwrap().clone(), |all, ops| {
            all.intersection(ops).cloned().collect()
        });
    for (name, ops) in &served {
        let own: std::collections::BTreeSet<&str> =
            ops.difference(&every).map(String::as_str).collect();
        let spec = read_models::spec(name).unwrap_or_else(|| panic!("{name} has no row"));
        let listed: std::collections::BTreeSet<&str> = spec.ops.iter().copied().collect();
        assert_eq!(own, listed, "{name}: served ops against the table");
    }

    // And a token beyond the stream is refused at once, not answered with the current ledger
    let beyond = engram_rpc::call::<_, ProjectorLedger>(
        bus.client(),
        &partition_subject(ProjectorName::FACTS.as_str(), "ledger", 0),
        &Consistency {
            min_seq: Some(expected.seq + 1),
            wait_ms: Some(50),
        },
        Duration::from_secs(5),
    )
    .await;
    assert!(
        matches!(&beyond, Err(e) if e.code() == ErrorCode::Invalid),
        "answered {beyond:?}"
    );

    // And every projector keeps its dead-letter id key in the state dir, so ids survive a
    // restart (a dead letter sent again after a crash is deduplicated)
    let key_of = |name: ProjectorName| {
        (0..partitions)
            .map(|p| {
                let dir = engram_projectors::partition_dir(dir.path(), p);
                std::fs::read(dir.join(format!("{name}.dlq-key")))
                    .unwrap_or_else(|e| panic!("{name} p{p} has no dead-letter key: {e}"))
            })
            .collect::<Vec<Vec<u8>>>()
    };
    let keys: Vec<Vec<Vec<u8>>> = ProjectorName::all().into_iter().map(key_of).collect();

    // And after a restart every projector holds the same ledger (restored from its
    // checkpoint, and replayed from there if the checkpoint lagged)
    stop.cancel();
    running.join().await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let bus_config = nats.bus_config();
    let running = engram_projectors::start(
        &config(),
        dir.path(),
        move |_, _| Bus::connect(bus_config.clone()),
        stop.clone(),
    )
    .await
    .unwrap();
    for name in ProjectorName::all() {
        let answer: ProjectorLedger = engram_projectors::ledger_of(
            bus.client(),
            name.as_str(),
            partitions,
            &wait,
            Duration::from_secs(15),
        )
        .await
        .unwrap_or_else(|e| panic!("{name} ledger after restart: {e}"));
        assert_eq!(answer.ledger, expected, "{name} after restart");
    }
    let after: Vec<Vec<Vec<u8>>> = ProjectorName::all().into_iter().map(key_of).collect();
    assert_eq!(keys, after, "dead-letter keys changed across a restart");
    stop.cancel();
    running.join().await.unwrap();
}

#[tokio::test]
async fn a_keyword_index_committed_without_a_ledger_asks_for_a_rebuild() {
    // Given a keyword index whose last commit carries a bare sequence (the old payload)
    let dir = tempfile::tempdir().unwrap();
    {
        let mut index = KeywordIndex::open(&dir.path().join("keyword")).unwrap();
        let memory = event("acme", "t1", "an old memory");
        index
            .add(&engram_memory::MemoryMeta::of(5, &memory), "an old memory")
            .unwrap();
        index.commit(5).unwrap();
    }

    // When the projection restores, then it refuses, naming the rebuild to run
    let projection = engram_projectors::keyword::KeywordProjection::new(dir.path());
    let err = projection.restore().await.unwrap_err();
    assert!(
        matches!(&err, ProjectionError::Fatal(m) if m.contains("`engram rebuild keyword`")),
        "{err:?}"
    );
}

/// An instance's snapshot gauges in the registry's text exposition, as `/metrics` serves
/// them: when its newest snapshot was cut (Unix seconds) and the sequence it holds.
fn snapshot_gauges(instance: &str) -> (Option<f64>, Option<f64>) {
    let text = engram_telemetry::metrics::render();
    let value = |name: &str| {
        let series = format!("{name}{{projector=\"{instance}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series)?.parse().ok())
    };
    (
        value("engram_snapshot_last_timestamp_seconds"),
        value("engram_snapshot_last_seq"),
    )
}

#[tokio::test]
async fn an_instance_reports_the_snapshot_it_cut_or_loaded_while_it_hosts_the_partition() {
    // Given the facts projector over events of one scope, all applied
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let events = events();
    let mut last: Seq = 0;
    for receipt in bus.append_batch(&events, 64).await {
        last = receipt.unwrap().seq;
    }
    let partitions = bus.config().stream.partitions;
    let holder = engram_memory::ScopeKey::of(&events[0]).partition(partitions);
    let instance = engram_projectors::instance_name("facts", holder);
    let config = ProjectorsConfig {
        run: vec![ProjectorName::FACTS],
        ..config()
    };
    let start = |dir: std::path::PathBuf, stop: tokio_util::sync::CancellationToken| {
        let (config, bus_config) = (config.clone(), nats.bus_config());
        async move {
            engram_projectors::start(
                &config,
                &dir,
                move |_, _| Bus::connect(bus_config.clone()),
                stop,
            )
            .await
            .unwrap()
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut running = start(dir.path().to_owned(), stop.clone()).await;
    let wait = Consistency {
        min_seq: Some(last),
        wait_ms: Some(10_000),
    };
    engram_projectors::ledger_of(
        bus.client(),
        "facts",
        partitions,
        &wait,
        Duration::from_secs(15),
    )
    .await
    .unwrap();
    // (an instance without a snapshot has no series: a zero would read as one from 1970)
    assert_eq!(snapshot_gauges(instance), (None, None));

    // When the scope's instance cuts a snapshot
    let meta: engram_snapshots::SnapshotMeta = engram_rpc::call(
        bus.client(),
        &partition_subject("facts", "snapshot", holder),
        &engram_projectors::SnapshotRequest::default(),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    assert_eq!(meta.version, last);

    // Then it reports when that snapshot was cut and the sequence it holds
    let cut_at = meta.created_at.timestamp_millis() as f64 / 1000.0;
    let (at, seq) = snapshot_gauges(instance);
    assert_eq!(seq, Some(last as f64));
    assert!(
        at.is_some_and(|at| (at - cut_at).abs() < 0.001),
        "cut at {cut_at}, reported {at:?}"
    );

    // And once the partition leaves this process, its series go with it (another process
    // cuts its snapshots now, and this one's would only age)
    running.remove_partition(holder).await.unwrap();
    assert_eq!(snapshot_gauges(instance), (None, None));
    stop.cancel();
    running.join().await.unwrap();

    // When a process holding nothing of the partition takes it, it loads that snapshot
    // and reports it
    let fresh = tempfile::tempdir().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let running = start(fresh.path().to_owned(), stop.clone()).await;
    engram_testkit::wait_until(
        "the loaded snapshot to be reported",
        Duration::from_secs(15),
        || async { snapshot_gauges(instance).1 == Some(last as f64) },
    )
    .await;
    let (at, _) = snapshot_gauges(instance);
    assert!(at.is_some_and(|at| (at - cut_at).abs() < 0.001), "{at:?}");
    stop.cancel();
    running.join().await.unwrap();
}
