//! A private network of Linux network namespaces, for tests that cut a node off the network.
//!
//! Loopback cannot be partitioned: every process on it reaches every other. Here each member
//! is a network namespace of its own with one address (`10.213.<n>.<i + 2>`), joined to a
//! bridge in ours (`10.213.<n>.1`), so the test process reaches every member and the members
//! reach each other. [`Lan::cut`] takes a member's link down: its packets go nowhere, its
//! peers' connections to it stall as they would across a broken switch, and a process
//! inside it (a server, or a client thread that [`Lan::enter`]ed it) still reaches its own
//! address only. [`Lan::heal`] brings the link back.
//!
//! It needs root (CAP_NET_ADMIN) and iproute2's `ip`. [`Lan::create`] says why it cannot be
//! made where they are missing, so that a test can skip with that reason. Dropping it deletes
//! the namespaces (which deletes their links) and the bridge.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::Command;

/// The first two octets of every lan's subnet.
const NET: [u8; 2] = [10, 213];

/// A bridge and its member namespaces; see the module docs.
#[derive(Debug)]
pub struct Lan {
    bridge: String,
    /// `10.213.<subnet>.0/24`.
    subnet: u8,
    members: Vec<Member>,
    /// Keeps the subnet ours among concurrent tests until dropped.
    _lock: File,
}

#[derive(Debug)]
struct Member {
    netns: String,
    /// The member's link as seen from our side: taken down to cut it off.
    link: String,
}

impl Lan {
    /// A lan of `members` namespaces; `Err` says why this machine cannot make one.
    pub fn create(members: usize) -> Result<Self, String> {
        if members == 0 || members > 200 {
            return Err(format!("{members} members: a lan has 1 to 200"));
        }
        let (subnet, lock) = reserve_subnet()?;
        // Short (interface names have at most 15 bytes) and unique on the machine: the subnet
        // is ours while the lock is held.
        let tag = format!("eg{subnet}");
        let mut lan = Self {
            bridge: format!("{tag}br"),
            subnet,
            members: Vec::new(),
            _lock: lock,
        };
        // Left over by a test that was killed before it could clean up.
        lan.remove_leftovers(members);
        ip(&["link", "add", &lan.bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", lan.gateway()),
            "dev",
            &lan.bridge,
        ])?;
        ip(&["link", "set", &lan.bridge, "up"])?;
        for i in 0..members {
            let member = Member {
                netns: format!("{tag}-{i}"),
                link: format!("{tag}v{i}"),
            };
            ip(&["netns", "add", &member.netns])?;
            lan.members.push(member);
            let member = &lan.members[i];
            ip(&[
                "link",
                "add",
                &member.link,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &member.netns,
            ])?;
            ip(&["link", "set", &member.link, "master", &lan.bridge])?;
            ip(&["link", "set", &member.link, "up"])?;
            let addr = format!("{}/24", lan.addr(i));
            ip(&["-n", &member.netns, "addr", "add", &addr, "dev", "eth0"])?;
            ip(&["-n", &member.netns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &member.netns, "link", "set", "lo", "up"])?;
        }
        Ok(lan)
    }

    /// Member `i`'s address.
    pub fn addr(&self, i: usize) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(NET[0], NET[1], self.subnet, i as u8 + 2))
    }

    /// Member `i`'s namespace, as a path a process or thread can enter.
    pub fn netns(&self, i: usize) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.members[i].netns)
    }

    /// Where each member runs a cluster node: its address and namespace.
    pub fn placement(&self) -> Vec<crate::Placement> {
        (0..self.members.len())
            .map(|i| crate::Placement {
                host: self.addr(i),
                netns: self.netns(i),
            })
            .collect()
    }

    /// Cuts member `i` off: nothing reaches it and nothing leaves it, until [`Lan::heal`].
    pub fn cut(&self, i: usize) {
        ip(&["link", "set", &self.members[i].link, "down"]).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Connects member `i` again.
    pub fn heal(&self, i: usize) {
        ip(&["link", "set", &self.members[i].link, "up"]).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Moves the calling thread into member `i`'s namespace; see [`enter`].
    pub fn enter(&self, i: usize) {
        enter(&self.netns(i));
    }

    fn gateway(&self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(NET[0], NET[1], self.subnet, 1))
    }

    fn remove_leftovers(&self, members: usize) {
        let tag = format!("eg{}", self.subnet);
        for i in 0..members {
            let _ = ip(&["link", "del", &format!("{tag}v{i}")]);
            let _ = ip(&["netns", "del", &format!("{tag}-{i}")]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        // Our end of each veth pair first: deleting it takes the peer with it at once, while
        // a deleted namespace (and its links) lingers until the kernel gets round to it.
        for member in &self.members {
            let _ = ip(&["link", "del", &member.link]);
            let _ = ip(&["netns", "del", &member.netns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// Moves the calling thread into the network namespace at `path`: every socket it opens
/// from now on is the namespace's. A namespace is per thread, so a client meant to sit on a
/// member's side runs a runtime of its own on a thread that entered it.
pub fn enter(path: &std::path::Path) {
    let file = File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    // SAFETY: setns(2) on an fd we hold open; it changes only this thread's namespace.
    let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
    assert_eq!(
        rc,
        0,
        "entering {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// Runs `ip <args>`; `Err` carries what it printed.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A `10.213.<n>.0/24` no other lan holds (a lock file per subnet, as port leases do) and no
/// interface of the machine uses.
fn reserve_subnet() -> Result<(u8, File), String> {
    let dir = std::env::temp_dir().join("engram-lan-locks");
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let used = Command::new("ip")
        .args(["-4", "-o", "addr"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    let start = std::process::id() as usize;
    for k in 0..256 {
        let subnet = ((start + k) % 256) as u8;
        if used.contains(&format!(" {}.{}.{subnet}.", NET[0], NET[1])) {
            continue;
        }
        let path = dir.join(format!("{subnet}.lock"));
        if let Some(lock) =
            crate::port::try_lock(&path).map_err(|e| format!("opening {}: {e}", path.display()))?
        {
            return Ok((subnet, lock));
        }
    }
    Err("every 10.213.x.0/24 subnet is in use".into())
}
