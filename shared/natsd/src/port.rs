//! Loopback ports that stay ours between a release and a reuse.
//!
//! A server restarted on the port it had (so that clients reconnect to the same address), or a
//! port kept closed on purpose (a service that is down), is only safe if nobody else can take
//! the port in between. Two things hand ports out on a machine: the kernel, to every
//! `bind(0)`, from its ephemeral range; and whoever picks a fixed port. A [`PortLease`] sits
//! outside the ephemeral range, so the kernel never hands it out, and holds an exclusive lock
//! on a file named after it, so no other lease anywhere on the machine takes it, until dropped.

use std::fs::{File, OpenOptions};
use std::path::PathBuf;

use crate::NatsdError;

/// How many ports are tried before giving up.
const ATTEMPTS: usize = 512;

/// A reserved loopback port; see the module docs. Nothing listens on it until its holder
/// binds it.
#[derive(Debug)]
pub struct PortLease {
    port: u16,
    /// Holds the lock for as long as the lease lives.
    _lock: File,
}

impl PortLease {
    /// Reserves a free port outside the kernel's ephemeral range.
    pub fn acquire() -> Result<Self, NatsdError> {
        let (low, high) = lease_range();
        let dir = lock_dir();
        std::fs::create_dir_all(&dir)
            .map_err(NatsdError::io(format!("creating {}", dir.display())))?;
        let span = u32::from(high - low) + 1;
        // A different start per process and call spreads concurrent test processes apart.
        let start = (std::process::id() ^ nanos()) % span;
        for i in 0..ATTEMPTS as u32 {
            let port = low + ((start + i * 7919) % span) as u16;
            let path = dir.join(format!("{port}.lock"));
            let Some(lock) =
                try_lock(&path).map_err(NatsdError::io(format!("opening {}", path.display())))?
            else {
                continue;
            };
            // Held by something that takes no lease (a fixed port of some other program).
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            return Ok(Self { port, _lock: lock });
        }
        Err(NatsdError::Io {
            action: format!("reserving a loopback port in {low}..={high}"),
            source: std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("{ATTEMPTS} ports tried, all taken"),
            ),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

/// The file at `path`, created if need be, locked exclusively: `None` while another holder
/// (in any process on the machine) has it. The lock lasts as long as the returned file.
pub(crate) fn try_lock(path: &std::path::Path) -> std::io::Result<Option<File>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    Ok(file.try_lock().is_ok().then_some(file))
}

/// Below the kernel's ephemeral range when there is room there, else above it; when the
/// ephemeral range leaves no room either side, inside it (the locks still keep leases apart).
fn lease_range() -> (u16, u16) {
    let (ephemeral_low, ephemeral_high) =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|text| {
                let mut parts = text.split_whitespace().map(|p| p.parse::<u16>().ok());
                Some((parts.next()??, parts.next()??))
            })
            .unwrap_or((32768, 60999));
    const ROOM: u16 = 2_000;
    if ephemeral_low >= 10_000 + ROOM {
        (10_000, ephemeral_low - 1)
    } else if ephemeral_high <= u16::MAX - ROOM {
        (ephemeral_high + 1, u16::MAX)
    } else {
        (10_000, 60_000)
    }
}

fn lock_dir() -> PathBuf {
    std::env::temp_dir().join("engram-port-leases")
}

fn nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let (low, high) = lease_range();
        let leases: Vec<PortLease> = (0..8).map(|_| PortLease::acquire().unwrap()).collect();
        let mut ports: Vec<u16> = leases.iter().map(PortLease::port).collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 8, "{ports:?}");
        for port in ports {
            assert!(
                (low..=high).contains(&port),
                "{port} outside {low}..={high}"
            );
            assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_ok());
        }
    }
}
