//! The physical reference, measured in the same run on the same server: plain JetStream
//! publishes of the sizes the instances appended, by as many publishers on the same open-loop
//! schedule, each with a `Nats-Msg-Id`, to a stream configured like the events stream; and a
//! consumer tailing that stream, which gives the floor for "written until readable".
//! Afterwards, a raw ordered consumer replays the whole events stream: the floor for what a
//! projector can read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use bytes::Bytes;
use engram_bus::Bus;
use futures::StreamExt;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::time::Instant;

use super::FleetError;
use super::record::{Latency, histogram};
use crate::engram::RAW_SUBJECT_PREFIX;
use crate::raw::RAW_STREAM;

#[derive(Clone, Debug, Serialize)]
pub struct Reference {
    pub publishers: usize,
    pub measured_secs: f64,
    pub publishes: u64,
    pub errors: u64,
    pub publishes_per_sec: f64,
    /// Publish until ack, from when it was due (the same open-loop measure as Engram's ack).
    pub ack_ms: Latency,
    /// Publish until a consumer tailing the stream received it.
    pub delivery_ms: Latency,
    /// A raw ordered consumer reading the whole events stream.
    pub replay_events: u64,
    pub replay_events_per_sec: f64,
}

/// Publishes for `duration` with `publishers` open-loop publishers, one message per `period`
/// each, sizes drawn from `sizes`; then replays the events stream.
pub(crate) async fn run(
    bus: &Bus,
    publishers: usize,
    period: Duration,
    duration: Duration,
    sizes: &[u32],
    seed: u64,
) -> Result<Reference, FleetError> {
    if sizes.is_empty() {
        return Err(FleetError::Verify(
            "no append was acknowledged, so there are no sizes for the raw reference".into(),
        ));
    }
    crate::raw::create_stream(bus)
        .await
        .map_err(|e| FleetError::Setup(e.to_string()))?;
    let sent: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let delivery = Arc::new(Mutex::new(histogram()));
    let consumer = tail(bus, sent.clone(), delivery.clone()).await?;
    let max = *sizes.iter().max().expect("not empty") as usize;
    let filler = crate::raw::filler(max);
    let sizes: Arc<Vec<u32>> = Arc::new(sizes.to_vec());
    let start = Instant::now() + Duration::from_millis(200);
    let end = start + duration;
    let tasks: Vec<_> = (0..publishers)
        .map(|i| {
            let js = bus.jetstream().clone();
            let (filler, sizes, sent) = (filler.clone(), sizes.clone(), sent.clone());
            tokio::spawn(publisher(
                i, js, filler, sizes, sent, start, end, period, seed,
            ))
        })
        .collect();
    let mut ack = histogram();
    let (mut publishes, mut errors) = (0u64, 0u64);
    let mut last = start;
    for task in tasks {
        let (h, ok, failed, finished) = task
            .await
            .map_err(|e| FleetError::Verify(format!("raw publisher failed: {e}")))?;
        ack.add(&h).expect("same bounds");
        publishes += ok;
        errors += failed;
        last = last.max(finished);
    }
    // Let the tail consumer see the last messages.
    tokio::time::sleep(Duration::from_millis(500)).await;
    consumer.abort();
    if let Err(e) = crate::raw::delete_stream(bus).await {
        tracing::warn!(error = %e, "reference stream left behind");
    }
    // Over the whole window, as for Engram's appends: with sparse schedules the last publish
    // can come well before the end.
    let measured_secs = (last - start).as_secs_f64().max(duration.as_secs_f64());
    let replay_start = Instant::now();
    let replay_events = crate::project::raw_ordered(bus)
        .await
        .map_err(|e| FleetError::Verify(e.to_string()))?;
    let replay_secs = replay_start.elapsed().as_secs_f64().max(1e-9);
    let delivery = delivery
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    Ok(Reference {
        publishers,
        measured_secs,
        publishes,
        errors,
        publishes_per_sec: publishes as f64 / measured_secs,
        ack_ms: Latency::of(&ack),
        delivery_ms: Latency::of(&delivery),
        replay_events,
        replay_events_per_sec: replay_events as f64 / replay_secs,
    })
}

#[allow(clippy::too_many_arguments)]
async fn publisher(
    index: usize,
    js: async_nats::jetstream::Context,
    filler: Bytes,
    sizes: Arc<Vec<u32>>,
    sent: Arc<Mutex<HashMap<String, Instant>>>,
    start: Instant,
    end: Instant,
    period: Duration,
    seed: u64,
) -> (hdrhistogram::Histogram<u64>, u64, u64, Instant) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ index as u64);
    let offset = period.mul_f64(rng.random::<f64>());
    let subject = format!("{RAW_SUBJECT_PREFIX}p{:03}", index % 256);
    let mut h = histogram();
    let (mut ok, mut failed) = (0, 0);
    let mut finished = start;
    for step in 0u32.. {
        let due = start + offset + period * step;
        // Fallen so far behind that the phase is over: stop, as the instances do, rather than
        // run the steps still owed late.
        if due >= end || Instant::now() >= end {
            break;
        }
        tokio::time::sleep_until(due).await;
        let size = sizes[rng.random_range(0..sizes.len())] as usize;
        let id = engram_schema::EventId::new().as_str().to_owned();
        let mut headers = HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        let now = Instant::now();
        sent.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, now);
        let result = match js
            .publish_with_headers(subject.clone(), headers, filler.slice(..size))
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let done = Instant::now();
        match result {
            Ok(()) => {
                ok += 1;
                let us = ((done - due).as_micros() as u64).clamp(1, 600_000_000);
                h.record(us).expect("clamped");
            }
            Err(_) => failed += 1,
        }
        finished = done;
    }
    (h, ok, failed, finished)
}

/// An ordered consumer on the reference stream, recording publish-to-delivery latency.
async fn tail(
    bus: &Bus,
    sent: Arc<Mutex<HashMap<String, Instant>>>,
    delivery: Arc<Mutex<hdrhistogram::Histogram<u64>>>,
) -> Result<tokio::task::JoinHandle<()>, FleetError> {
    let err = |e: &dyn std::fmt::Display| FleetError::Setup(format!("reference consumer: {e}"));
    let stream = bus
        .jetstream()
        .get_stream(RAW_STREAM)
        .await
        .map_err(|e| err(&e))?;
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await
        .map_err(|e| err(&e))?;
    let mut messages = consumer.messages().await.map_err(|e| err(&e))?;
    Ok(tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            let now = Instant::now();
            let id = message
                .headers
                .as_ref()
                .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                .map(|v| v.as_str().to_owned());
            let Some(id) = id else { continue };
            let at = sent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&id);
            if let Some(at) = at {
                let us = ((now - at).as_micros() as u64).clamp(1, 600_000_000);
                delivery
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .record(us)
                    .expect("clamped");
            }
        }
    }))
}
