//! The events stream is partitioned by nats-server itself: every stored subject carries the
//! partition of its tenant and scope, the same number [`engram_schema::partition_of`] computes
//! (what routing relies on), a partition's reader gets exactly its scopes' events in order,
//! and a stream partitioned otherwise, or not at all, is refused with what to do.

use std::collections::BTreeMap;

use async_nats::jetstream::stream;
use engram_bus::{BusError, StartAt};
use engram_schema::{SubjectFilter, partition_filter, partition_of_event, subject_partition};
use engram_testkit::{TestNats, event};
use futures::StreamExt;

#[tokio::test]
async fn the_server_stores_each_scope_in_the_partition_engram_computes() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let partitions = bus.config().stream.partitions;
    assert_eq!(partitions, engram_schema::DEFAULT_PARTITIONS);

    // Given events of 64 scopes of two tenants, three each
    let mut events = Vec::new();
    for round in 0..3 {
        for tenant in ["acme", "umbrella"] {
            for scope in 0..32 {
                events.push(event(
                    tenant,
                    &format!("t{scope}"),
                    &format!("round {round}"),
                ));
            }
        }
    }
    for e in &events {
        bus.append(e, Default::default()).await.unwrap();
    }

    // Then every stored subject ends in the partition computed here
    let stored: Vec<_> = bus
        .replay(&SubjectFilter::all(), StartAt::Beginning)
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(stored.len(), events.len());
    let mut by_partition: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for item in &stored {
        let item = item.as_ref().unwrap();
        let p = subject_partition(&item.subject).unwrap_or_else(|| panic!("{}", item.subject));
        assert_eq!(
            p,
            partition_of_event(&item.event, partitions),
            "{}",
            item.subject
        );
        by_partition.entry(p).or_default().push(item.seq);
    }
    assert!(
        by_partition.len() > 8,
        "64 scopes spread over {by_partition:?}"
    );

    // And a durable reader of one partition gets exactly its events, in stream order
    let (&p, seqs) = by_partition.iter().next().unwrap();
    let mut reader = bus
        .durable_reader_of("partition-test", &partition_filter(p), 0, 100)
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < seqs.len() {
        let batch = reader.next_batch(100).await.unwrap().unwrap();
        for d in &batch {
            let e = d.event.as_ref().unwrap();
            assert_eq!(partition_of_event(&e.event, partitions), p);
            got.push(d.seq);
        }
    }
    assert_eq!(&got, seqs);
}

#[tokio::test]
async fn a_stream_partitioned_otherwise_or_not_at_all_is_refused_with_the_fix() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let name = bus.config().stream.name.clone();
    let js = bus.jetstream().clone();

    // Given the stream made with 8 partitions
    js.delete_stream(&name).await.unwrap();
    let mut eight = bus.wanted_stream_config();
    let (source, destination) = engram_schema::stream_transform(8);
    eight.subject_transform = Some(stream::SubjectTransform {
        source,
        destination,
    });
    js.create_stream(eight).await.unwrap();
    // Then provisioning with 16 refuses, naming both counts and the setting
    match bus.provision().await {
        Err(e @ BusError::Partitions { .. }) => {
            let text = e.to_string();
            assert!(text.contains("split into 8 partitions"), "{text}");
            assert!(text.contains("bus.stream.partitions = 8"), "{text}");
        }
        other => panic!("expected a partitions error, got {other:?}"),
    }

    // Given the stream as an engram before partitions made it
    js.delete_stream(&name).await.unwrap();
    let unpartitioned = stream::Config {
        subject_transform: None,
        ..bus.wanted_stream_config()
    };
    js.create_stream(unpartitioned).await.unwrap();
    match bus.provision().await {
        Err(e @ BusError::Partitions { existing: None, .. }) => {
            assert!(e.to_string().contains("not partitioned"), "{e}");
        }
        other => panic!("expected a partitions error, got {other:?}"),
    }
}
