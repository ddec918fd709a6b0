//! CPU time of this process and of the local nats-server, sampled at the edges of a phase's
//! measured window. Per-event CPU explains a throughput ratio where wall-clock figures
//! cannot: on a shared 2-core machine, every client microsecond is one the server lacks.

use std::time::Duration;

/// CPU time used so far by this process (user plus system, all threads).
pub(crate) fn own() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// CPU time used so far by another process, from `/proc/<pid>/stat`; `None` if unreadable.
pub(crate) fn of_pid(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces; fields are counted after its closing parenthesis.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_micros(ticks * 1_000_000 / hz))
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_own_cpu_both_ways() {
        let start = super::own();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        std::hint::black_box(x);
        assert!(super::own() > start);
        assert!(super::of_pid(std::process::id()).is_some());
        assert!(super::of_pid(u32::MAX).is_none());
    }
}
