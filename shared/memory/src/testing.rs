//! Given/when/then helpers for the tests and benches of the scoped models (fact table, skill
//! registry): events with chosen times, a stream that applies them at seqs 1, 2, 3, …, and
//! the snapshot round trips behind "a rebuild equals the incremental model".
//!
//! Only with the `test-util` feature. Helpers panic with a readable message instead of
//! returning errors: they run only in tests and benches.

use std::fmt::Debug;

use chrono::{DateTime, Duration, Utc};
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::model::EventModel;
use crate::{ScopeKey, Seq};

/// `2024-01-01` or a full RFC 3339 timestamp.
pub fn t(text: &str) -> DateTime<Utc> {
    let full = if text.len() == 10 {
        format!("{text}T00:00:00Z")
    } else {
        text.to_owned()
    };
    DateTime::parse_from_rfc3339(&full)
        .unwrap_or_else(|e| panic!("bad test time {text}: {e}"))
        .with_timezone(&Utc)
}

/// `n` days after 2024-01-01, as RFC 3339.
pub fn day(n: i64) -> String {
    (t("2024-01-01") + Duration::days(n)).to_rfc3339()
}

/// The scope of team `team` in `tenant`.
pub fn scope(tenant: &str, team: &str) -> ScopeKey {
    ScopeKey::new(
        Ident::parse("tenant", tenant).unwrap_or_else(|e| panic!("{e}")),
        Scope::new(ScopeKind::Team, team).unwrap_or_else(|e| panic!("{e}")),
    )
}

/// Teams `team-0` to `team-{n-1}` of `tenant`.
pub fn teams(tenant: &str, n: usize) -> Vec<ScopeKey> {
    (0..n)
        .map(|i| scope(tenant, &format!("team-{i}")))
        .collect()
}

/// An event of `agent-1` (instance `inst-1`) with no text, that occurred, and was recorded,
/// at `at`.
pub fn event(
    scope: &ScopeKey,
    layer: Layer,
    kind: EventKind,
    data: Option<Value>,
    at: DateTime<Utc>,
) -> Envelope {
    let mut event = Envelope::new(
        scope.tenant.clone(),
        scope.scope(),
        Ident::parse("agent_id", "agent-1").unwrap_or_else(|e| panic!("{e}")),
        Ident::parse("instance_id", "inst-1").unwrap_or_else(|e| panic!("{e}")),
        layer,
        kind,
        Content {
            text: String::new(),
            data,
        },
    );
    event.occurred_at = at;
    event.recorded_at = at;
    event
}

/// A model fed at seqs 1, 2, 3, … like a projector reading the stream.
#[derive(Default)]
pub struct Stream<M> {
    pub model: M,
    /// The seq of the last event applied.
    pub seq: Seq,
}

impl<M: EventModel + Default> Stream<M> {
    /// Applies `event` at the next seq.
    pub fn apply(&mut self, event: &Envelope) -> Result<M::Applied, M::Error> {
        self.seq += 1;
        self.model.apply(self.seq, event)
    }

    /// A stream that has applied `events`; panics if one is refused.
    pub fn given(events: &[Envelope]) -> Self
    where
        M::Error: Debug,
    {
        let mut stream = Self {
            model: M::default(),
            seq: 0,
        };
        for event in events {
            stream.apply(event).expect("given events apply");
        }
        stream
    }
}

/// A model fed `events` at seqs 1, 2, 3, … in one pass, refusals included.
pub fn one_pass<M: EventModel + Default>(events: &[Envelope]) -> M {
    let mut model = M::default();
    for (i, event) in events.iter().enumerate() {
        let _ = model.apply(i as Seq + 1, event);
    }
    model
}

/// Applies `events[..split]`, round-trips the model through `codec`, applies the rest.
pub fn in_two_halves<M: EventModel + Default>(
    events: &[Envelope],
    split: usize,
    codec: impl Fn(&M) -> M,
) -> M {
    let mut model = M::default();
    for (i, event) in events.iter().enumerate() {
        if i == split {
            model = codec(&model);
        }
        let _ = model.apply(i as Seq + 1, event);
    }
    if split == events.len() {
        model = codec(&model);
    }
    model
}

/// A round trip through MessagePack with field names, as checkpoints are written.
pub fn named<M: Serialize + DeserializeOwned>(model: &M) -> M {
    rmp_serde::from_slice(&rmp_serde::to_vec_named(model).expect("encodes")).expect("decodes")
}

/// A round trip through MessagePack without field names.
pub fn compact<M: Serialize + DeserializeOwned>(model: &M) -> M {
    rmp_serde::from_slice(&rmp_serde::to_vec(model).expect("encodes")).expect("decodes")
}

/// A round trip through JSON, as someone looking inside a snapshot would read it.
pub fn as_json<M: Serialize + DeserializeOwned>(model: &M) -> M {
    serde_json::from_str(&serde_json::to_string(model).expect("encodes")).expect("decodes")
}

/// Asserts that splitting `events` anywhere, with a snapshot round trip in any encoding
/// between the halves, ends in the state one pass reaches by state hash: for models whose
/// state (an automerge document) has no meaningful `==`.
pub fn assert_rebuild_equals_incremental_by_hash<M>(events: &[Envelope])
where
    M: EventModel + Default + Serialize + DeserializeOwned,
{
    let whole: M = one_pass(events);
    for split in 0..=events.len() {
        for codec in [named, compact, as_json] {
            let halves: M = in_two_halves(events, split, codec);
            assert_eq!(halves.state_hash(), whole.state_hash(), "split at {split}");
        }
    }
}

/// Asserts that splitting `events` anywhere, with a snapshot round trip in any encoding
/// between the halves, ends in the state one pass reaches: equal hash, equal model.
pub fn assert_rebuild_equals_incremental<M>(events: &[Envelope])
where
    M: EventModel + Default + PartialEq + Debug + Serialize + DeserializeOwned,
{
    let whole: M = one_pass(events);
    for split in 0..=events.len() {
        for codec in [named, compact, as_json] {
            let halves: M = in_two_halves(events, split, codec);
            assert_eq!(halves.state_hash(), whole.state_hash(), "split at {split}");
            assert_eq!(halves, whole, "split at {split}");
        }
    }
}
