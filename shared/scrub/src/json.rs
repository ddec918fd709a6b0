//! [`scrub_json`]: every string of a JSON value, scrubbed in place.

use serde_json::Value;

use crate::policy::Kind;
use crate::scrubber::Scrubber;

/// Scrubs every string inside a JSON value in place (object values and array items, at any
/// depth); returns the redactions' kinds in document order.
///
/// An object's key counts as the name before its value: `{"password": "hunter2"}` is
/// redacted although the string alone is no secret. Keys themselves are left alone.
///
/// The walk uses an explicit stack rather than recursion, so a deeply nested value can
/// neither overflow the stack nor keep a string out of reach of the scrubber.
pub fn scrub_json(scrubber: &Scrubber, value: &mut Value) -> Vec<Kind> {
    let mut kinds = Vec::new();
    let mut stack: Vec<(Option<&str>, &mut Value)> = vec![(None, value)];
    while let Some((key, value)) = stack.pop() {
        match value {
            Value::String(s) => {
                let scrubbed = scrubber.scrub_value(key, s);
                if !scrubbed.is_clean() {
                    kinds.extend(scrubbed.redactions.iter().map(|r| r.kind));
                    let text = scrubbed.text.into_owned();
                    *s = text;
                }
            }
            // Reversed, so that the stack pops them in document order.
            Value::Array(items) => stack.extend(items.iter_mut().rev().map(|v| (None, v))),
            Value::Object(map) => {
                stack.extend(map.iter_mut().rev().map(|(k, v)| (Some(k.as_str()), v)));
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
    kinds
}
