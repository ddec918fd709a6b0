//! In-process routes: the endpoints this process serves, callable without NATS.
//!
//! A memory node hosts the read models of its partitions in the same process as the query
//! service that asks them. Asking them over NATS cost a publish, a hop through the server,
//! a JSON encode and decode each way and a reply, for every partition and model of every
//! query: under load that queueing, not the searches, was most of a retrieval's time. An
//! endpoint served with [`Routes`] is also entered here under its subject, and a caller in
//! the process that finds a subject here calls the handler directly, with the request value
//! itself (no encoding), under the same in-flight bound and deadline as a NATS request, and
//! counted in the same metrics.
//!
//! It must never be a way around a check: only code in the process can reach it, and the
//! handler is the very one the NATS endpoint runs, validation included.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use engram_memory::proto::ErrorCode;
use engram_telemetry::metrics;
use tokio_util::sync::CancellationToken;

use crate::{BUSY_RETRY_AFTER, EndpointLimits, Failure};

type Erased = Box<dyn Any + Send>;
type ErasedFuture = Pin<Box<dyn Future<Output = Result<Erased, Failure>> + Send>>;

/// One served endpoint, with its request and response types erased.
pub(crate) trait Route: Send + Sync {
    fn call(&self, subject: &str, request: Erased, timeout: Duration) -> ErasedFuture;
}

/// The in-process table of a process's endpoints, by subject. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct LocalRoutes(Arc<RwLock<HashMap<String, Arc<dyn Route>>>>);

impl std::fmt::Debug for LocalRoutes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LocalRoutes").field(&self.len()).finish()
    }
}

impl LocalRoutes {
    /// Subjects served in this process.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `subject` is served in this process.
    pub fn serves(&self, subject: &str) -> bool {
        self.read().contains_key(subject)
    }

    /// The endpoint of `subject` in this process, if it is served here; `None` when it is
    /// not (ask over NATS then).
    pub fn route(&self, subject: &str) -> Option<LocalRoute> {
        let route = self.read().get(subject).cloned()?;
        Some(LocalRoute {
            subject: subject.to_owned(),
            route,
        })
    }

    pub(crate) fn insert(&self, subject: &str, route: Arc<dyn Route>) {
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(subject.to_owned(), route);
    }

    pub(crate) fn remove(&self, subject: &str) {
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(subject);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<dyn Route>>> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }
}

/// An endpoint served in this process.
pub struct LocalRoute {
    subject: String,
    route: Arc<dyn Route>,
}

impl LocalRoute {
    /// Calls the endpoint with `request`, as a NATS request with `timeout` would. `Req` and
    /// `Resp` must be the endpoint's own types: a mismatch is a bug, answered as an internal
    /// failure rather than a panic.
    pub async fn call<Req, Resp>(self, request: Req, timeout: Duration) -> Result<Resp, Failure>
    where
        Req: Send + 'static,
        Resp: Send + 'static,
    {
        let answer = self.route.call(&self.subject, Box::new(request), timeout);
        answer.await?.downcast::<Resp>().map(|r| *r).map_err(|_| {
            Failure::new(
                ErrorCode::Internal,
                format!(
                    "{}: the in-process endpoint answers another type",
                    self.subject
                ),
            )
        })
    }
}

/// Where an endpoint is served besides NATS, and what ends it: entered into `local` while
/// it serves, and stopped (unsubscribed, and removed from `local`) when `stop` is
/// cancelled. A memory node serves each partition's endpoints with the partition's own
/// token, so giving up a partition ends exactly its endpoints.
#[derive(Clone, Debug)]
pub struct Routes {
    pub local: Option<LocalRoutes>,
    pub stop: CancellationToken,
    /// The in-flight slots, when shared with other endpoints (one op served on many
    /// subjects, such as each partition's routed queries): their requests together are
    /// bounded by the limits' `max_in_flight`, not each subject's alone.
    pub permits: Option<Arc<tokio::sync::Semaphore>>,
}

impl Routes {
    /// Entered in `local` too, until `stop`.
    pub fn new(local: LocalRoutes, stop: CancellationToken) -> Self {
        Self {
            local: Some(local),
            stop,
            permits: None,
        }
    }

    /// Over NATS only, until `stop`.
    pub fn until(stop: CancellationToken) -> Self {
        Self {
            local: None,
            stop,
            permits: None,
        }
    }

    /// With in-flight slots shared with the other endpoints given the same.
    pub fn sharing(self, permits: Arc<tokio::sync::Semaphore>) -> Self {
        Self {
            permits: Some(permits),
            ..self
        }
    }
}

/// A typed endpoint's handler as a [`Route`], sharing the NATS endpoint's in-flight permits.
pub(crate) struct Typed<Req, Resp, H> {
    pub(crate) handler: Arc<H>,
    pub(crate) permits: Arc<tokio::sync::Semaphore>,
    pub(crate) limits: EndpointLimits,
    pub(crate) op: &'static str,
    pub(crate) types: PhantomData<fn(Req) -> Resp>,
}

impl<Req, Resp, H, Fut> Route for Typed<Req, Resp, H>
where
    Req: Send + 'static,
    Resp: Send + 'static,
    H: Fn(&str, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, Failure>> + Send + 'static,
{
    fn call(&self, subject: &str, request: Erased, timeout: Duration) -> ErasedFuture {
        let op = self.op;
        let request = match request.downcast::<Req>() {
            Ok(request) => *request,
            Err(_) => {
                let failure = Failure::new(
                    ErrorCode::Internal,
                    format!("{subject}: the in-process endpoint takes another request type"),
                );
                return Box::pin(async move { Err(failure) });
            }
        };
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            metrics::QUERIES.with_label_values(&[op, "busy"]).inc();
            let busy = Failure::new(
                ErrorCode::Busy,
                format!(
                    "{subject} is busy: {} requests in flight; retry after {} ms",
                    self.limits.max_in_flight,
                    BUSY_RETRY_AFTER.as_millis()
                ),
            );
            return Box::pin(async move { Err(busy) });
        };
        let deadline = timeout.min(self.limits.max_duration);
        let answer = (self.handler)(subject, request);
        Box::pin(async move {
            let _permit = permit;
            let started = Instant::now();
            let result = crate::within(deadline, answer).await;
            crate::counted(op, started, &result);
            result.map(|r| Box::new(r) as Erased)
        })
    }
}
