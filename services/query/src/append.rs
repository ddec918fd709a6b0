//! Appends by agents (`engram.q.<tenant>.<agent>.append`).
//!
//! An agent's key may publish on its own query subjects and nowhere else: a JetStream
//! publish is acknowledged at whatever reply subject the publisher names, by the server
//! itself, so a key that could publish to the log could make the server write its ack into
//! another tenant's events, a KV bucket or the JetStream API. Through this endpoint the
//! service appends with its own connection, whose acks come back to its own inbox, after
//! checking each event against the caller its subject names: the tenant, the `agent_id`,
//! and a scope the key may write. The deduplication key is the same as for any append
//! (`<tenant>:<event id>`), so a retried request stores nothing twice.

use engram_bus::{AppendError, AppendOptions, AppendReceipt};
use engram_memory::proto::limits::MAX_APPEND_EVENTS;
use engram_memory::proto::{self, AppendFailure, AppendRequest, AppendResponse, AppendResult};
use engram_rpc::Failure;
use engram_telemetry::metrics;

use crate::{Query, access};

impl Query {
    /// The agent of `subject` appends `request.events`: each refused event is that event's
    /// `forbidden` result, the others are appended in one pipelined batch.
    pub async fn append_as(
        &self,
        subject: &str,
        request: AppendRequest,
    ) -> Result<AppendResponse, Failure> {
        let (tenant, agent) = access::caller(subject)?;
        let n = request.events.len();
        if n == 0 || n > MAX_APPEND_EVENTS {
            return Err(Failure::invalid(format!(
                "events: {n} events; an append carries 1..={MAX_APPEND_EVENTS} (split a larger batch)"
            )));
        }
        if request.expected_last_subject_seq.is_some() && n != 1 {
            return Err(Failure::invalid(
                "expected_last_subject_seq applies to one event: send the event alone",
            ));
        }
        let mut results: Vec<Option<AppendResult>> = vec![None; n];
        let mut allowed = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        for (i, event) in request.events.into_iter().enumerate() {
            let refusal = if event.tenant != tenant {
                Some(format!(
                    "event {i}: these credentials are of tenant {tenant}; the event names tenant {}",
                    event.tenant
                ))
            } else if event.agent_id != agent {
                Some(format!(
                    "event {i}: this key is agent {agent}; the event names agent {}",
                    event.agent_id
                ))
            } else if let Some(guard) = self.access.get()
                && !guard.may_write(&tenant, &agent, &event.scope).await
            {
                Some(format!(
                    "event {i}: agent {agent} of tenant {tenant} may not write {}: its key covers only the scopes it was issued for (`engram agent list --tenant {tenant}`)",
                    event.scope
                ))
            } else {
                None
            };
            match refusal {
                Some(message) => {
                    metrics::ACCESS_DENIED.with_label_values(&["append"]).inc();
                    results[i] = Some(failed("forbidden", message));
                }
                None => {
                    positions.push(i);
                    allowed.push(event);
                }
            }
        }
        let receipts = match (allowed.as_slice(), request.expected_last_subject_seq) {
            ([event], expected) => vec![
                self.bus
                    .append(
                        event,
                        AppendOptions {
                            expected_last_subject_seq: expected,
                            trace: None,
                        },
                    )
                    .await,
            ],
            ([], _) => Vec::new(),
            (events, _) => {
                self.bus
                    .append_batch(events, self.bus.config().max_inflight)
                    .await
            }
        };
        for (i, receipt) in positions.into_iter().zip(receipts) {
            results[i] = Some(result_of(receipt));
        }
        Ok(AppendResponse {
            results: results
                .into_iter()
                .map(|r| r.expect("every event has a result"))
                .collect(),
        })
    }
}

impl Query {
    /// The consolidation plan of the request's scope; with `apply`, its events appended
    /// with this service's connection (each authored by the consolidator, with an id
    /// derived from its inputs, so a repeated apply stores nothing twice). For an agent
    /// (`subject`), only events in scopes its key may write are appended; the others are
    /// `forbidden` results.
    pub async fn consolidate_as(
        &self,
        subject: Option<&str>,
        request: proto::ConsolidateRequest,
    ) -> Result<proto::ConsolidateResponse, Failure> {
        let apply = request.apply;
        let mut plan = self.consolidate(request).await?;
        if !apply || plan.events.is_empty() {
            return Ok(plan);
        }
        let caller = subject.map(access::caller).transpose()?;
        let mut results: Vec<Option<AppendResult>> = vec![None; plan.events.len()];
        let mut allowed = Vec::new();
        let mut positions = Vec::new();
        for (i, event) in plan.events.iter().enumerate() {
            let refused = match (&caller, self.access.get()) {
                (Some((tenant, _)), _) if &event.tenant != tenant => true,
                (Some((tenant, agent)), Some(guard)) => {
                    !guard.may_write(tenant, agent, &event.scope).await
                }
                _ => false,
            };
            if refused {
                metrics::ACCESS_DENIED.with_label_values(&["append"]).inc();
                results[i] = Some(failed(
                    "forbidden",
                    format!(
                        "planned event {i} is in {}, which this key may not write",
                        event.scope
                    ),
                ));
            } else {
                positions.push(i);
                allowed.push(event.clone());
            }
        }
        let receipts = self
            .bus
            .append_batch(&allowed, self.bus.config().max_inflight)
            .await;
        for (i, receipt) in positions.into_iter().zip(receipts) {
            results[i] = Some(result_of(receipt));
        }
        plan.results = results
            .into_iter()
            .map(|r| r.expect("every event has a result"))
            .collect();
        Ok(plan)
    }
}

fn failed(kind: &str, message: String) -> AppendResult {
    AppendResult {
        seq: None,
        duplicate: false,
        bytes: 0,
        error: Some(AppendFailure {
            kind: kind.to_owned(),
            message,
            size: None,
            max: None,
        }),
    }
}

fn result_of(receipt: Result<AppendReceipt, AppendError>) -> AppendResult {
    match receipt {
        Ok(r) => AppendResult {
            seq: Some(r.seq),
            duplicate: r.duplicate,
            bytes: r.bytes as u64,
            error: None,
        },
        Err(e) => {
            let mut result = failed(e.kind(), e.to_string());
            if let (AppendError::TooLarge { size, max }, Some(f)) = (&e, result.error.as_mut()) {
                f.size = Some(*size as u64);
                f.max = Some(*max as u64);
            }
            result
        }
    }
}

/// The subject an agent appends on (`engram.q.<tenant>.<agent>.append`).
pub fn op() -> &'static str {
    proto::APPEND.rsplit('.').next().unwrap_or("append")
}
