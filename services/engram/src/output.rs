//! How the CLI prints events and receipts: short text lines, or JSON lines with `--json`.

use engram_bus::StoredEvent;
use engram_schema::Envelope;
use engram_sdk::{AppendError, AppendReceipt};

pub fn event(stored: &StoredEvent, json: bool) {
    if json {
        let line = serde_json::json!({
            "seq": stored.seq,
            "subject": stored.subject,
            "stored_at": stored.stored_at,
            "traceparent": stored.trace.map(|t| t.to_string()),
            "expects": stored.expects,
            "event": stored.event,
        });
        println!("{line}");
        return;
    }
    let e = &stored.event;
    println!(
        "{:>8}  {}  {}/{}  {}/{}  {:<14} {}",
        stored.seq,
        e.occurred_at.format("%Y-%m-%d %H:%M:%S"),
        e.tenant,
        e.scope,
        e.agent_id,
        e.instance_id,
        e.kind,
        one_line(&e.content.text, 100)
    );
}

pub fn receipt(r: &AppendReceipt, event: &Envelope, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::json!({"ok": true, "seq": r.seq, "duplicate": r.duplicate, "subject": r.subject, "event_id": r.event_id})
        );
    } else if r.duplicate {
        println!(
            "duplicate  seq={}  id={}  (already stored; not written again)",
            r.seq, r.event_id
        );
    } else {
        println!(
            "appended   seq={}  id={}  {}  {}",
            r.seq, r.event_id, r.subject, event.kind
        );
    }
}

pub fn append_error(event: &Envelope, e: &AppendError, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::json!({"ok": false, "event_id": event.event_id, "error": e.to_string(), "kind": e.kind(), "retryable": e.is_retryable()})
        );
    } else {
        eprintln!("failed     id={}  {e}", event.event_id);
    }
}

/// Collapses whitespace and cuts at `max` characters, for one-line listings.
pub fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}
