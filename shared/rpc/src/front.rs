//! The front door: where requests are admitted or refused, on a thread of its own.
//!
//! Every endpoint's accept loop ([`crate::serve`] and its kin) runs here. Admitting a request
//! is a permit and a spawn onto the runtime that serves the endpoint; refusing one is a
//! single `busy` reply. On the process's async workers, beside the work they admit, both
//! waited behind every admitted request's queued task once the cores were full: at 1.05–1.5×
//! the capacity of a 2-core machine, refusals took 0.3–3.9 s (p99) to come back, longer than
//! the answers (docs/benchmarks.md, issue 27 §3). Here the queue in front of admission is
//! empty, and the thread sleeps between requests (so the kernel runs it as soon as one
//! arrives): a refusal comes back at once and a caller can back off, and only the admitted
//! work slows down.
//!
//! A service facing clients connects its responder here too ([`run`]): the connection's
//! reads and writes then are this thread's as well, not queued behind the work.

use std::future::Future;
use std::sync::OnceLock;

static FRONT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

fn front() -> &'static tokio::runtime::Runtime {
    FRONT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("engram-front")
            .enable_all()
            .build()
            .expect("the front door's runtime starts (a thread and an event loop)")
    })
}

/// The front door's runtime, to spawn an accept loop on.
pub fn handle() -> tokio::runtime::Handle {
    front().handle().clone()
}

/// Runs `work` on the front door's runtime and waits for it; its panic is this caller's.
/// What `work` spawns (a connection's reader and writer) stays there.
pub async fn run<F>(work: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match front().spawn(work).await {
        Ok(output) => output,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only the runtime's shutdown cancels its tasks, and it lives as long as the process.
        Err(e) => panic!("the front door dropped a task: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_runs_on_the_front_thread_and_a_panic_reaches_the_caller() {
        let name = run(async { std::thread::current().name().map(str::to_owned) }).await;
        assert_eq!(name.as_deref(), Some("engram-front"));
        let spawned = run(async {
            tokio::spawn(async { std::thread::current().id() })
                .await
                .unwrap()
        })
        .await;
        let front_thread = run(async { std::thread::current().id() }).await;
        assert_eq!(
            spawned, front_thread,
            "what it spawns stays on the front thread"
        );
        let caught = tokio::spawn(run(async { panic!("a bug") })).await;
        assert!(caught.is_err_and(|e| e.is_panic()));
    }
}
