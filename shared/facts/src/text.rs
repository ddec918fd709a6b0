//! Words for [`crate::FactTable::search`]: lowercase runs of letters and digits.

use std::collections::BTreeSet;

use serde_json::Value;

pub(crate) fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|word| !word.is_empty())
        .map(str::to_lowercase)
}

/// The words of a JSON value: its strings, numbers, booleans and object keys.
pub(crate) fn json_words(value: &Value, into: &mut BTreeSet<String>) {
    match value {
        Value::Null => {}
        Value::Bool(b) => {
            into.insert(b.to_string());
        }
        Value::Number(n) => into.extend(words(&n.to_string())),
        Value::String(s) => into.extend(words(s)),
        Value::Array(items) => {
            for item in items {
                json_words(item, into);
            }
        }
        Value::Object(map) => {
            for (key, item) in map {
                into.extend(words(key));
                json_words(item, into);
            }
        }
    }
}
