//! When the load ends: `duration` after its start, or later while a chaos fault holds it
//! open.
//!
//! A fault is timed until the system has recovered, and appends resuming is part of that. On
//! a busy machine an earlier fault's recovery can push a later one so close to `duration`
//! that nothing is left to append, and the recovery could not be seen at all. So a fault
//! holds the load open while it is timed. When the last hold is released past the end, the
//! end moves to the first whole period after the release: every instance has exactly one
//! step in each period, so the steps due are still `instances x periods`, a count the
//! schedule gives, and only the number of periods depends on the machine.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// The load's end, shared by the instances and the chaos task.
pub(crate) struct LoadSpan {
    start: Instant,
    period: Duration,
    state: Mutex<State>,
}

struct State {
    /// No step due at or after this runs, unless a hold is on.
    end: Instant,
    holds: usize,
}

/// Keeps the load going while alive (see [`LoadSpan::hold`]).
pub(crate) struct Hold(Arc<LoadSpan>);

impl LoadSpan {
    pub(crate) fn new(start: Instant, duration: Duration, period: Duration) -> Arc<Self> {
        Arc::new(Self {
            start,
            period,
            state: Mutex::new(State {
                end: start + duration,
                holds: 0,
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds the load open until the hold is dropped; `None` if it has already ended.
    pub(crate) fn hold(self: &Arc<Self>) -> Option<Hold> {
        self.take_hold(Instant::now()).then(|| Hold(self.clone()))
    }

    fn take_hold(&self, now: Instant) -> bool {
        let mut state = self.state();
        if state.holds == 0 && now >= state.end {
            return false;
        }
        state.holds += 1;
        true
    }

    fn release(&self, now: Instant) {
        let mut state = self.state();
        state.holds -= 1;
        if state.holds == 0 && now >= state.end {
            let period = self.period.as_nanos().max(1);
            let periods = now.saturating_duration_since(self.start).as_nanos() / period + 1;
            let nanos = u64::try_from(period * periods).unwrap_or(u64::MAX);
            state.end = self.start + Duration::from_nanos(nanos);
        }
    }

    /// Whether the step due at `due` is part of the load. Asked at `due` or later: a step
    /// due while a hold was on is, because the hold's release moves the end past it.
    pub(crate) fn includes(&self, due: Instant) -> bool {
        let state = self.state();
        state.holds > 0 || due < state.end
    }

    /// The end, once it has passed at `now` with no hold on: it no longer moves then.
    pub(crate) fn ended(&self, now: Instant) -> Option<Instant> {
        let state = self.state();
        (state.holds == 0 && now >= state.end).then_some(state.end)
    }

    /// The end as it stands, and whether a hold may still move it.
    pub(crate) fn end(&self) -> (Instant, bool) {
        let state = self.state();
        (state.end, state.holds > 0)
    }

    /// How long the load lasted, or has lasted so far.
    pub(crate) fn length(&self) -> Duration {
        self.state().end.saturating_duration_since(self.start)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.release(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(start: Instant, millis: u64) -> Instant {
        start + Duration::from_millis(millis)
    }

    #[test]
    fn a_hold_released_past_the_end_moves_it_to_the_next_whole_period() {
        let start = Instant::now();
        let span = LoadSpan::new(start, Duration::from_secs(2), Duration::from_millis(500));
        assert!(span.take_hold(at(start, 1_900)));
        // Held: every step is part of the load, even past `duration`.
        assert!(span.includes(at(start, 3_100)));
        assert_eq!(span.ended(at(start, 3_200)), None);
        span.release(at(start, 3_200));
        // Released at 3.2 s: the load ends at 3.5 s, seven whole periods.
        assert_eq!(span.length(), Duration::from_millis(3_500));
        assert!(span.includes(at(start, 3_100)));
        assert!(!span.includes(at(start, 3_500)));
        assert_eq!(span.ended(at(start, 3_400)), None);
        assert_eq!(span.ended(at(start, 3_500)), Some(at(start, 3_500)));
        // Over: a later fault cannot hold it open again.
        assert!(!span.take_hold(at(start, 3_500)));
    }

    #[test]
    fn a_hold_released_before_the_end_leaves_it_where_it_was() {
        let start = Instant::now();
        let span = LoadSpan::new(start, Duration::from_secs(2), Duration::from_millis(500));
        assert!(span.take_hold(at(start, 1_000)));
        assert!(span.take_hold(at(start, 1_500)));
        span.release(at(start, 2_600));
        // Another hold is still on.
        assert!(span.includes(at(start, 2_500)));
        span.release(at(start, 2_700));
        assert_eq!(span.length(), Duration::from_secs(3));

        let span = LoadSpan::new(start, Duration::from_secs(10), Duration::from_millis(500));
        assert!(span.take_hold(at(start, 1_000)));
        span.release(at(start, 9_000));
        assert_eq!(span.length(), Duration::from_secs(10));
        assert!(span.hold().is_some(), "the load is still on");
    }
}
