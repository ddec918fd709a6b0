//! W3C trace context (`traceparent`) carried in NATS message headers.
//!
//! The appender puts a `traceparent` on every event; readers surface it, so an operator can
//! join an agent's log line to every service that handled its event. A caller inside a trace
//! of its own passes that context and the event becomes a child span of it.

use std::fmt;

/// The NATS header that carries the context, named as in the W3C spec.
pub const HEADER: &str = "traceparent";

/// A parsed `traceparent`: version 00, 16-byte trace id, 8-byte parent span id, flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

impl TraceContext {
    /// A new trace with a random id.
    pub fn new_root() -> Self {
        Self {
            trace_id: rand::random::<u128>().max(1),
            span_id: rand::random::<u64>().max(1),
            sampled: true,
        }
    }

    /// A new span in the same trace.
    pub fn child(&self) -> Self {
        Self {
            span_id: rand::random::<u64>().max(1),
            ..*self
        }
    }

    /// Parses `00-<32 hex>-<16 hex>-<2 hex>`; anything else (including all-zero ids) is `None`.
    pub fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|&t| t != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|&s| s != 0)?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(Self {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id,
            self.span_id,
            u8::from(self.sampled)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_malformed_headers() {
        let root = TraceContext::new_root();
        let child = root.child();
        assert_eq!(child.trace_id, root.trace_id);
        assert_eq!(TraceContext::parse(&child.to_string()), Some(child));
        let spec = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(TraceContext::parse(spec).unwrap().to_string(), spec);
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-xyz-abc-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
    }
}
