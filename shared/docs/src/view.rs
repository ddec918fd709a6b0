//! A document rendered as JSON, with its conflicts.
//!
//! automerge resolves a field written concurrently by two instances to one winner, the same
//! on every replica, and keeps the others. The view shows the winner in `value` and lists
//! every field with more than one value in `conflicts`, all values included (the winner
//! first), so a conflict is never silently dropped.
//!
//! The walk is bounded: a document nested deeper than [`MAX_VIEW_DEPTH`] or larger than
//! [`MAX_VIEW_NODES`] values is cut there and marked `truncated`. Documents come from
//! clients; a hostile one must cost a bounded walk, not a stack.

use automerge::{ObjId, ObjType, Prop, ReadDoc, ScalarValue, Value};
use base64::Engine as _;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// Deepest nesting a view renders.
pub const MAX_VIEW_DEPTH: usize = 64;
/// Most values a view renders.
pub const MAX_VIEW_NODES: usize = 200_000;

/// One field with concurrent values, as the query protocol carries it.
pub use engram_memory::proto::DocConflict as Conflict;

/// A document's state as JSON, with its conflicts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DocView {
    pub value: Json,
    pub conflicts: Vec<Conflict>,
    /// Set when the walk hit [`MAX_VIEW_DEPTH`] or [`MAX_VIEW_NODES`].
    pub truncated: bool,
}

impl DocView {
    pub fn of(doc: &impl ReadDoc) -> Self {
        let mut walk = Walk {
            doc,
            conflicts: Vec::new(),
            nodes: 0,
            truncated: false,
        };
        let value = walk.object(&automerge::ROOT, ObjType::Map, "", 0);
        Self {
            value,
            conflicts: walk.conflicts,
            truncated: walk.truncated,
        }
    }
}

struct Walk<'a, D> {
    doc: &'a D,
    conflicts: Vec<Conflict>,
    nodes: usize,
    truncated: bool,
}

impl<D: ReadDoc> Walk<'_, D> {
    fn object(&mut self, obj: &ObjId, kind: ObjType, path: &str, depth: usize) -> Json {
        if depth >= MAX_VIEW_DEPTH {
            self.truncated = true;
            return Json::Null;
        }
        match kind {
            ObjType::Map | ObjType::Table => {
                let mut map = serde_json::Map::new();
                for key in self.doc.keys(obj) {
                    let child = format!("{path}/{}", escape(&key));
                    if let Some(value) = self.field(obj, Prop::Map(key.clone()), &child, depth) {
                        map.insert(key, value);
                    }
                }
                Json::Object(map)
            }
            ObjType::List => {
                let mut items = Vec::new();
                for index in 0..self.doc.length(obj) {
                    let child = format!("{path}/{index}");
                    items.push(
                        self.field(obj, Prop::Seq(index), &child, depth)
                            .unwrap_or(Json::Null),
                    );
                }
                Json::Array(items)
            }
            ObjType::Text => Json::String(self.doc.text(obj).unwrap_or_default()),
        }
    }

    /// The winning value of one field, recording a conflict when it has several.
    fn field(&mut self, obj: &ObjId, prop: Prop, path: &str, depth: usize) -> Option<Json> {
        self.nodes += 1;
        if self.nodes > MAX_VIEW_NODES {
            self.truncated = true;
            return None;
        }
        let all = self.doc.get_all(obj, prop).ok()?;
        let mut values: Vec<Json> = all
            .into_iter()
            .map(|(value, id)| self.value(value, &id, path, depth))
            .collect();
        // get_all lists the winner last; views show it first.
        values.reverse();
        let winner = values.first().cloned()?;
        if values.len() > 1 {
            self.conflicts.push(Conflict {
                path: path.to_owned(),
                values,
            });
        }
        Some(winner)
    }

    fn value(&mut self, value: Value<'_>, id: &ObjId, path: &str, depth: usize) -> Json {
        match value {
            Value::Object(kind) => self.object(id, kind, path, depth + 1),
            Value::Scalar(scalar) => scalar_json(&scalar),
        }
    }
}

/// A scalar as JSON: counters and timestamps as numbers, bytes as base64.
pub fn scalar_json(scalar: &ScalarValue) -> Json {
    match scalar {
        ScalarValue::Str(s) => Json::String(s.to_string()),
        ScalarValue::Int(i) | ScalarValue::Timestamp(i) => Json::from(*i),
        ScalarValue::Uint(u) => Json::from(*u),
        ScalarValue::F64(f) => serde_json::Number::from_f64(*f).map_or(Json::Null, Json::Number),
        ScalarValue::Counter(c) => Json::from(i64::from(c)),
        ScalarValue::Boolean(b) => Json::Bool(*b),
        ScalarValue::Bytes(b) => Json::String(base64::engine::general_purpose::STANDARD.encode(b)),
        ScalarValue::Null | ScalarValue::Unknown { .. } => Json::Null,
    }
}

/// A key as a JSON-pointer token (RFC 6901).
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}
