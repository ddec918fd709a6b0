//! Dialogue ids (`D3:14`) and the lenient reading of LoCoMo's evidence strings.
//!
//! Turn ids in the released data are clean; evidence ids were typed by annotators and are not.
//! Known shapes, all from `locomo10.json`: `D8:6; D9:17` and `D9:1 D4:4 D4:6` (several ids in one
//! string), `D:11:26` (a stray colon), `D30:05` (a zero-padded turn) and a bare `D`. Every
//! repair here is one that cannot change which turn is meant; anything else is reported, never
//! guessed.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One turn of a conversation: session `session`, turn `turn`, shown as `D{session}:{turn}`.
///
/// Ordered by session, then turn, which is conversation order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DiaId {
    pub session: u32,
    pub turn: u32,
}

/// A string that does not name exactly one dialogue id.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{raw:?} is not a dialogue id like D3:14")]
pub struct DiaIdError {
    raw: String,
}

impl DiaIdError {
    fn new(raw: &str) -> Self {
        Self {
            raw: raw.to_owned(),
        }
    }

    /// The text that could not be read, as it appeared.
    pub fn raw(&self) -> &str {
        &self.raw
    }
}

impl DiaId {
    pub const fn new(session: u32, turn: u32) -> Self {
        Self { session, turn }
    }

    /// Reads one id, repairing what cannot change its meaning: surrounding and inner
    /// whitespace, a lowercase `d`, a colon right after the `D` (`D:11:26`), zero padding
    /// (`D30:05`), and a missing `D` (`3:14`). Fails on anything else, including several ids.
    pub fn parse(raw: &str) -> Result<Self, DiaIdError> {
        let compact: String = raw.chars().filter(|c| !c.is_whitespace()).collect();
        let rest = match compact.strip_prefix(['D', 'd']) {
            Some(after_d) => after_d.strip_prefix(':').unwrap_or(after_d),
            None => &compact,
        };
        let (session, turn) = rest.split_once(':').ok_or_else(|| DiaIdError::new(raw))?;
        Ok(Self {
            session: parse_number(session).ok_or_else(|| DiaIdError::new(raw))?,
            turn: parse_number(turn).ok_or_else(|| DiaIdError::new(raw))?,
        })
    }

    /// Reads one evidence string, which may pack several ids separated by `;`, `,` or
    /// whitespace. Yields one result per id found, in order; a fragment that is not an id
    /// (a bare `D`, an empty string) comes back as an error carrying that fragment, so the
    /// caller can count it rather than lose it.
    pub fn parse_evidence(raw: &str) -> Vec<Result<Self, DiaIdError>> {
        let mut found = Vec::new();
        for piece in raw.split([';', ',']) {
            // Every `D` opens a new id; whitespace alone cannot be the separator, because
            // `D 11:26` is one id with a stray space while `D9:1 D4:4` is two.
            for fragment in split_before_d(piece) {
                let fragment = fragment.trim();
                if fragment.is_empty() {
                    continue;
                }
                found.push(Self::parse(fragment));
            }
        }
        if found.is_empty() {
            found.push(Err(DiaIdError::new(raw)));
        }
        found
    }
}

fn parse_number(digits: &str) -> Option<u32> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Splits `piece` so that each part but the first starts with a `D` or `d`.
fn split_before_d(piece: &str) -> impl Iterator<Item = &str> {
    let mut starts: Vec<usize> = piece
        .char_indices()
        .filter(|&(i, c)| i > 0 && (c == 'D' || c == 'd'))
        .map(|(i, _)| i)
        .collect();
    starts.insert(0, 0);
    starts.push(piece.len());
    let bounds: Vec<(usize, usize)> = starts.windows(2).map(|w| (w[0], w[1])).collect();
    bounds.into_iter().map(move |(from, to)| &piece[from..to])
}

impl fmt::Display for DiaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "D{}:{}", self.session, self.turn)
    }
}

impl FromStr for DiaId {
    type Err = DiaIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// As its display form, `"D3:14"`, so reports and stored metadata read like the dataset.
impl Serialize for DiaId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DiaId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        raw.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(raw: &str) -> Vec<Result<DiaId, String>> {
        DiaId::parse_evidence(raw)
            .into_iter()
            .map(|r| r.map_err(|e| e.raw().to_owned()))
            .collect()
    }

    #[test]
    fn clean_ids_round_trip_through_display() {
        for raw in ["D1:1", "D3:14", "D32:120"] {
            let id: DiaId = raw.parse().unwrap();
            assert_eq!(id.to_string(), raw);
        }
        assert_eq!(DiaId::parse("D3:14").unwrap(), DiaId::new(3, 14));
    }

    #[test]
    fn stray_colon_after_d_is_dropped() {
        assert_eq!(ids("D:11:26"), vec![Ok(DiaId::new(11, 26))]);
    }

    #[test]
    fn zero_padding_is_dropped() {
        assert_eq!(ids("D30:05"), vec![Ok(DiaId::new(30, 5))]);
        assert_eq!(DiaId::parse("D030:005").unwrap().to_string(), "D30:5");
    }

    #[test]
    fn whitespace_and_case_are_ignored() {
        assert_eq!(ids("  D3:4 "), vec![Ok(DiaId::new(3, 4))]);
        assert_eq!(ids("D 3 : 4"), vec![Ok(DiaId::new(3, 4))]);
        assert_eq!(ids("d3:4"), vec![Ok(DiaId::new(3, 4))]);
        assert_eq!(ids("3:4"), vec![Ok(DiaId::new(3, 4))]);
    }

    #[test]
    fn packed_lists_are_split() {
        let want = vec![Ok(DiaId::new(8, 6)), Ok(DiaId::new(9, 17))];
        assert_eq!(ids("D8:6; D9:17"), want);
        assert_eq!(ids("D8:6,D9:17"), want);
        assert_eq!(ids("D8:6 D9:17"), want);
        assert_eq!(ids("D8:6;"), vec![Ok(DiaId::new(8, 6))]);
        assert_eq!(
            ids("D9:1 D4:4 D4:6"),
            vec![
                Ok(DiaId::new(9, 1)),
                Ok(DiaId::new(4, 4)),
                Ok(DiaId::new(4, 6))
            ]
        );
    }

    #[test]
    fn unreadable_fragments_are_returned_not_dropped() {
        assert_eq!(ids("D"), vec![Err("D".to_owned())]);
        assert_eq!(ids(""), vec![Err(String::new())]);
        assert_eq!(ids("  "), vec![Err("  ".to_owned())]);
        assert_eq!(
            ids("D4:4; D; D5"),
            vec![
                Ok(DiaId::new(4, 4)),
                Err("D".to_owned()),
                Err("D5".to_owned())
            ]
        );
        for bad in [
            "D3",
            "D3:",
            "D:3",
            "D3:4:5",
            "D3:x",
            "D-3:4",
            "E3:4",
            "D99999999999:1",
        ] {
            assert!(DiaId::parse(bad).is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn several_ids_are_not_one() {
        assert!(DiaId::parse("D8:6; D9:17").is_err());
        assert!(DiaId::parse("D8:6D9:17").is_err());
    }

    #[test]
    fn serialises_as_display_form() {
        let id = DiaId::new(3, 14);
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"D3:14\"");
        assert_eq!(serde_json::from_str::<DiaId>("\"D3:14\"").unwrap(), id);
        assert!(serde_json::from_str::<DiaId>("\"nope\"").is_err());
    }

    #[test]
    fn orders_by_session_then_turn() {
        let mut ids = vec![DiaId::new(10, 1), DiaId::new(2, 30), DiaId::new(2, 4)];
        ids.sort();
        assert_eq!(
            ids,
            vec![DiaId::new(2, 4), DiaId::new(2, 30), DiaId::new(10, 1)]
        );
    }
}
