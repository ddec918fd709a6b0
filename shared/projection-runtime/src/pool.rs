//! Where models apply their batches: threads of their own, at a lower CPU priority than the
//! rest of the process.
//!
//! Applying is the heavy, deferrable part of a node: indexing, inserting vectors, merging
//! documents, a catch-up of a whole partition. On the process's async workers it held them
//! for the length of a batch, so a query's request, a reply, an agent's append through the
//! query service and the connection's own reads waited behind it; and with nats-server on
//! the same cores (`engram up`), it competed with the log's acknowledgements on equal terms.
//! Here the batches run on a runtime of their own whose threads are `nice`: they take all
//! the CPU nobody else wants, and yield it to the log, the queries and the appends the moment
//! those need it. A projector falls a little behind under a burst instead of everything
//! waiting for it.
//!
//! One pool per process, configured once before the first batch ([`configure`]); unconfigured,
//! it has a thread per core at [`PoolSettings::default`]'s niceness.

use std::future::Future;
use std::sync::OnceLock;

/// The apply pool's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolSettings {
    /// Threads applying at once; 0 means one per core.
    pub threads: usize,
    /// How much lower than the process's their priority is (Linux `nice` steps, 0..=19): 5
    /// gives a waiting query or ack about three times an apply thread's share of a busy core.
    /// 0 keeps the process's. Elsewhere than Linux, ignored.
    pub nice: i32,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            threads: 0,
            nice: 5,
        }
    }
}

static SETTINGS: OnceLock<PoolSettings> = OnceLock::new();
static POOL: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

/// The pool was started (or configured) before; it keeps those settings.
#[derive(Debug, thiserror::Error)]
#[error("the apply pool is already configured ({0:?}); configure it once, before projectors start")]
pub struct AlreadyConfigured(pub PoolSettings);

/// Sets the pool's shape; the first call wins, and a later one with other settings is an
/// error (the same settings again are not).
pub fn configure(settings: PoolSettings) -> Result<(), AlreadyConfigured> {
    let settings = PoolSettings {
        nice: settings.nice.clamp(0, 19),
        ..settings
    };
    let held = *SETTINGS.get_or_init(|| settings);
    if held == settings {
        Ok(())
    } else {
        Err(AlreadyConfigured(held))
    }
}

/// The settings the pool runs (or will run) with.
pub fn settings() -> PoolSettings {
    *SETTINGS.get_or_init(PoolSettings::default)
}

fn pool() -> &'static tokio::runtime::Runtime {
    POOL.get_or_init(|| {
        let settings = settings();
        let threads = match settings.threads {
            0 => std::thread::available_parallelism().map_or(2, usize::from),
            n => n,
        };
        let nice = settings.nice;
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("engram-apply")
            .enable_all()
            // Blocking threads too: a model's `spawn_blocking` inside a batch is the batch's work.
            .on_thread_start(move || lower_priority(nice))
            .build()
            .expect("the apply pool's runtime starts (threads and an event loop)")
    })
}

/// Runs `work` on the apply pool and waits for it; its panic is this caller's.
pub async fn run<F>(work: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match pool().spawn(work).await {
        Ok(output) => output,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only the pool's shutdown cancels its tasks, and it lives as long as the process.
        Err(e) => panic!("the apply pool dropped a batch: {e}"),
    }
}

/// Lowers the calling thread's priority by `nice` steps. Best effort: a failure leaves the
/// thread at the process's priority, which is how it ran before this pool existed.
fn lower_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // On Linux the nice value is per thread: PRIO_PROCESS with a thread id sets that
        // thread's alone.
        // SAFETY: plain syscalls on the calling thread's own id, no memory passed.
        let result = unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            let current = libc::getpriority(libc::PRIO_PROCESS, tid);
            libc::setpriority(libc::PRIO_PROCESS, tid, (current + nice).min(19))
        };
        if result != 0 {
            tracing::debug!(
                nice,
                error = %std::io::Error::last_os_error(),
                "apply thread keeps the process's priority"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_runs_on_the_pool_at_the_lower_priority_and_a_panic_reaches_the_caller() {
        let name = run(async { std::thread::current().name().map(str::to_owned) }).await;
        assert_eq!(name.as_deref(), Some("engram-apply"));
        #[cfg(target_os = "linux")]
        {
            let mine = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            let theirs = run(async {
                unsafe {
                    libc::getpriority(
                        libc::PRIO_PROCESS,
                        libc::syscall(libc::SYS_gettid) as libc::id_t,
                    )
                }
            })
            .await;
            assert_eq!(theirs, (mine + settings().nice).min(19));
        }
        let caught = tokio::spawn(run(async { panic!("a model's bug") })).await;
        assert!(caught.is_err_and(|e| e.is_panic()));
    }
}
