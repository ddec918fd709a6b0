//! Which stream partitions a process serves (`projectors.partitions`): a memory node owns
//! some of them, and another node the rest.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Most partitions a set may name: a stream has at most this many (see
/// `engram_schema::MAX_PARTITIONS`), so a spec naming more is a typo or an attack on the
/// parser, refused before anything is allocated.
const MAX_NAMED: u32 = engram_schema::MAX_PARTITIONS;

/// Stream partitions: every one (`"all"`, the default), or a list of partitions and ranges
/// (`"0-7,12"`). In TOML and `ENGRAM_PROJECTORS__PARTITIONS` a string, a number or a list
/// of numbers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartitionSet(Option<BTreeSet<u32>>);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PartitionSetError {
    #[error(
        "partitions {0:?}: expected \"all\" or partitions and ranges such as \"0-7,12\" (each a number from 0)"
    )]
    Syntax(String),
    #[error("partitions {0:?}: the range {1}-{2} runs backwards; write it low-high")]
    Backwards(String, u32, u32),
    #[error("partitions {spec:?}: a stream has at most {MAX_NAMED} partitions")]
    TooMany { spec: String },
    #[error("partitions {0:?}: names no partition")]
    Empty(String),
    #[error(
        "projectors.partitions names partition {partition}, but the events stream has {partitions} (0-{}); name partitions below {partitions}",
        partitions - 1
    )]
    Outside { partition: u32, partitions: u32 },
}

impl PartitionSet {
    /// Every partition.
    pub fn all() -> Self {
        Self(None)
    }

    /// No partition.
    pub fn none() -> Self {
        Self(Some(BTreeSet::new()))
    }

    pub fn is_all(&self) -> bool {
        self.0.is_none()
    }

    pub fn contains(&self, partition: u32) -> bool {
        self.0.as_ref().is_none_or(|set| set.contains(&partition))
    }

    /// The partitions of a stream of `partitions` this set names, ascending; an error when
    /// it names one the stream does not have (a node configured for another stream).
    pub fn within(&self, partitions: u32) -> Result<Vec<u32>, PartitionSetError> {
        match &self.0 {
            None => Ok((0..partitions).collect()),
            Some(set) => match set.iter().find(|&&p| p >= partitions) {
                Some(&partition) => Err(PartitionSetError::Outside {
                    partition,
                    partitions,
                }),
                None => Ok(set.iter().copied().collect()),
            },
        }
    }
}

impl FromStr for PartitionSet {
    type Err = PartitionSetError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let syntax = || PartitionSetError::Syntax(spec.to_owned());
        let trimmed = spec.trim();
        if trimmed.eq_ignore_ascii_case("all") {
            return Ok(Self::all());
        }
        let number = |s: &str| -> Result<u32, PartitionSetError> {
            let s = s.trim();
            if s.is_empty() || s.len() > 6 || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(syntax());
            }
            let n: u32 = s.parse().map_err(|_| syntax())?;
            if n >= MAX_NAMED {
                return Err(PartitionSetError::TooMany {
                    spec: spec.to_owned(),
                });
            }
            Ok(n)
        };
        let mut set = BTreeSet::new();
        for item in trimmed.split(',') {
            let (low, high) = match item.split_once('-') {
                Some((low, high)) => (number(low)?, number(high)?),
                None => {
                    let n = number(item)?;
                    (n, n)
                }
            };
            if high < low {
                return Err(PartitionSetError::Backwards(spec.to_owned(), low, high));
            }
            set.extend(low..=high);
        }
        if set.is_empty() {
            return Err(PartitionSetError::Empty(spec.to_owned()));
        }
        Ok(Self(Some(set)))
    }
}

impl fmt::Display for PartitionSet {
    /// The spec [`FromStr`] reads back: ranges folded, `all` for every partition.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(set) = &self.0 else {
            return f.write_str("all");
        };
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for &p in set {
            match runs.last_mut() {
                Some((_, high)) if *high + 1 == p => *high = p,
                _ => runs.push((p, p)),
            }
        }
        let text: Vec<String> = runs
            .into_iter()
            .map(|(low, high)| {
                if low == high {
                    low.to_string()
                } else {
                    format!("{low}-{high}")
                }
            })
            .collect();
        f.write_str(&text.join(","))
    }
}

impl Serialize for PartitionSet {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PartitionSet {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// What the config layers give: the env layer reads `3` as a number.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Spec {
            Text(String),
            One(u32),
            List(Vec<u32>),
        }
        let spec = match Spec::deserialize(deserializer)? {
            Spec::Text(text) => text,
            Spec::One(n) => n.to_string(),
            Spec::List(list) => {
                if list.len() > MAX_NAMED as usize {
                    return Err(serde::de::Error::custom(format!(
                        "partitions: a stream has at most {MAX_NAMED} partitions"
                    )));
                }
                list.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            }
        };
        spec.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_fold_and_refuse_what_they_cannot_mean() {
        let set: PartitionSet = " 0-3, 7,5 ,6".parse().unwrap();
        assert_eq!(set.to_string(), "0-3,5-7");
        assert_eq!(set.within(16).unwrap(), vec![0, 1, 2, 3, 5, 6, 7]);
        assert!(set.contains(6) && !set.contains(4));
        assert_eq!(
            set.within(6).unwrap_err(),
            PartitionSetError::Outside {
                partition: 6,
                partitions: 6
            }
        );
        let all: PartitionSet = "ALL".parse().unwrap();
        assert!(all.is_all() && all.contains(9_000));
        assert_eq!(all.within(3).unwrap(), vec![0, 1, 2]);
        assert_eq!(all.to_string().parse::<PartitionSet>().unwrap(), all);
        for bad in ["", "x", "1-", "-1", "1--2", "1,,2", "+1", "1.5", "0x3"] {
            assert!(
                matches!(
                    bad.parse::<PartitionSet>(),
                    Err(PartitionSetError::Syntax(_))
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            "5-2".parse::<PartitionSet>(),
            Err(PartitionSetError::Backwards(_, 5, 2))
        ));
        // A huge range is refused by its bound, not by allocating it.
        assert!(matches!(
            "0-4000000000".parse::<PartitionSet>(),
            Err(PartitionSetError::Syntax(_))
        ));
        assert!(matches!(
            format!("0-{MAX_NAMED}").parse::<PartitionSet>(),
            Err(PartitionSetError::TooMany { .. })
        ));
    }

    #[test]
    fn the_config_layers_give_a_string_a_number_or_a_list() {
        #[derive(Deserialize)]
        struct Config {
            partitions: PartitionSet,
        }
        let read = |toml: &str| toml::from_str::<Config>(toml).map(|c| c.partitions.to_string());
        assert_eq!(read("partitions = \"8-15\"").unwrap(), "8-15");
        assert_eq!(read("partitions = 3").unwrap(), "3");
        assert_eq!(read("partitions = [1, 2, 3, 9]").unwrap(), "1-3,9");
        let err = read("partitions = \"8-x\"").unwrap_err().to_string();
        assert!(err.contains("0-7,12"), "{err}");
    }
}
