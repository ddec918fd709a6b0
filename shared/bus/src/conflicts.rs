//! Optimistic-concurrency conflicts that only show once two logs meet.
//!
//! An append with an expected last sequence is checked by the stream it is stored in. On a
//! leaf whose link to the hub is down, the leaf's stream and the hub's check their own
//! appends, and both may accept one that expected the same predecessor. Once the link is
//! back, both logs hold both: neither append was refused, yet one of them was not made on
//! what it expected. Each such append carries what it expected as an event id
//! ([`crate::append::EXPECTS_HEADER`]), the same on every side, so every side finds the same
//! conflicts in the same order, and reports them rather than keeping one silently.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::StoredEvent;

/// Appends to one subject that expected the same predecessor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Conflict {
    /// The subject they were appended to (tenant, scope and layer), without the partition.
    pub subject: String,
    /// The event id they expected to follow, or `-` for an empty subject.
    pub expects: String,
    /// Each of them, by event id.
    pub events: Vec<ConflictingEvent>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ConflictingEvent {
    pub event_id: String,
    /// Where it is stored here (differs from side to side).
    pub seq: u64,
    pub agent_id: String,
    pub instance_id: String,
}

/// The conflicts among `events` (any order, any mix of subjects), sorted by subject and
/// expectation, each one's events by id: the same list wherever the same events are read.
pub fn find<'a>(events: impl IntoIterator<Item = &'a StoredEvent>) -> Vec<Conflict> {
    let mut groups: BTreeMap<(String, String), BTreeMap<String, ConflictingEvent>> =
        BTreeMap::new();
    for e in events {
        let Some(expects) = &e.expects else { continue };
        let subject = engram_schema::subject_for(&e.event);
        groups
            .entry((subject, expects.clone()))
            .or_default()
            .insert(
                e.event.event_id.to_string(),
                ConflictingEvent {
                    event_id: e.event.event_id.to_string(),
                    seq: e.seq,
                    agent_id: e.event.agent_id.to_string(),
                    instance_id: e.event.instance_id.to_string(),
                },
            );
    }
    groups
        .into_iter()
        .filter(|(_, events)| events.len() > 1)
        .map(|((subject, expects), events)| Conflict {
            subject,
            expects,
            events: events.into_values().collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(seq: u64, text: &str, expects: Option<&str>) -> StoredEvent {
        StoredEvent {
            seq,
            subject: String::new(),
            stored_at: chrono::Utc::now(),
            pending: 0,
            trace: None,
            expects: expects.map(str::to_owned),
            event: engram_testkit::event("acme", "t1", text),
        }
    }

    #[test]
    fn two_appends_that_expected_the_same_predecessor_conflict_in_any_order() {
        let a = stored(5, "hub", Some("E1"));
        let b = stored(9, "leaf", Some("E1"));
        let c = stored(10, "after", Some("X"));
        let plain = stored(11, "plain", None);
        let one = find([&a, &b, &c, &plain]);
        let other = find([&plain, &c, &b, &a]);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].expects, "E1");
        assert_eq!(one[0].events.len(), 2);
        let ids = |c: &[Conflict]| -> Vec<String> {
            c[0].events.iter().map(|e| e.event_id.clone()).collect()
        };
        assert_eq!(ids(&one), ids(&other));
        assert!(find([&a, &c, &plain]).is_empty());
    }
}
