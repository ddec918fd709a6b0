//! What the process tests share.

// Each test binary includes this module and uses a part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// Lines of a child's output, read on a thread of their own, so that waiting for one gives up
/// at a deadline instead of blocking for as long as the child prints nothing.
pub struct Lines {
    rx: Receiver<String>,
    seen: Vec<String>,
}

impl Lines {
    pub fn of(stream: impl Read + Send + 'static) -> Self {
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            rx,
            seen: Vec::new(),
        }
    }

    /// The first line from here on that contains `wanted`; an error saying what happened if
    /// none comes within `timeout` or the output ends first.
    pub fn until(&mut self, wanted: &str, timeout: Duration) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(wanted) {
                        return Ok(line);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("no {wanted:?} line within {timeout:?}"));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!("the output ended before a {wanted:?} line"));
                }
            }
        }
    }

    /// Every line read so far.
    pub fn seen(&self) -> &[String] {
        &self.seen
    }
}
