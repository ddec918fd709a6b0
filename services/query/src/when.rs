//! The dates a query names, and how near a memory's time is to them.
//!
//! "What did Maria donate in December 2023?", "the painting shown on October 13, 2023",
//! "what did I decide yesterday": a question that names a time asks about memories from
//! then. Ranking lifts a memory by its nearness to such a date ([`Mentions::nearness`]),
//! so the date in a question counts for the time a memory happened, which neither BM25
//! (the memory's text rarely repeats its own date) nor the embedding sees.
//!
//! Read here, in the order they are tried at each word:
//! - ISO dates: `2023-05-08`;
//! - a month name with a day and a year, or with either: `October 13, 2023`, `Oct 13th
//!   2023`, `October 2023`, `June 5th`;
//! - a day before a month: `13 October 2023`, `1 February, 2023`, `3rd of June`;
//! - a month name alone after a preposition (`in June`, `since May`): that month of any
//!   year, since the question does not say which. "May" elsewhere is the verb;
//! - a year alone: `in 2023`;
//! - relative to the time of the request: `today`, `yesterday`, `this` or `last`
//!   `week`/`month`/`year`, `3 days ago`, `a week ago`, `two months ago`.
//!
//! A date library parses one string known to be a date; this finds dates inside free
//! text and keeps their granularity (a month is a month, not its first day), which the
//! crates that extract dates from sentences return as a single day. The work is one pass
//! over at most [`MAX_WORDS`] words and keeps at most [`MAX_MENTIONS`] dates.

use chrono::{DateTime, Datelike, Days, Months, NaiveDate, Utc};

/// Words of a query read for dates; a question names its dates early, and a query beyond
/// this is not a question.
pub const MAX_WORDS: usize = 256;
/// Dates kept from one query.
pub const MAX_MENTIONS: usize = 8;

/// One time a query names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mention {
    /// `[start, end)`, UTC days.
    Span { start: NaiveDate, end: NaiveDate },
    /// A month (and a day in it) without a year: the same days of every year.
    EveryYear { month: u32, day: Option<u32> },
}

/// The dates of one query.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mentions(pub Vec<Mention>);

impl Mentions {
    /// The dates `query` names; relative ones ("yesterday") against `now`.
    pub fn parse(query: &str, now: DateTime<Utc>) -> Self {
        let words: Vec<String> = words(query).take(MAX_WORDS).collect();
        let today = now.date_naive();
        let mut found = Vec::new();
        let mut i = 0;
        while i < words.len() && found.len() < MAX_MENTIONS {
            let (mention, used) = read_at(&words, i, today);
            if let Some(mention) = mention {
                found.push(mention);
            }
            i += used.max(1);
        }
        Self(found)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// 1 for a memory from within a named date, falling by half for every `half_life_days`
    /// it lies outside the nearest one (a half-life of 0: nothing outside is near); 0 when
    /// the query names none.
    pub fn nearness(&self, at: DateTime<Utc>, half_life_days: f64) -> f32 {
        let distance = self
            .0
            .iter()
            .map(|m| m.distance_days(at))
            .fold(f64::INFINITY, f64::min);
        if distance == 0.0 {
            1.0
        } else if half_life_days > 0.0 {
            0.5f64.powf(distance / half_life_days) as f32
        } else {
            0.0
        }
    }
}

impl Mention {
    fn span(start: NaiveDate, end: NaiveDate) -> Self {
        Self::Span { start, end }
    }

    /// Days from `at` to the nearest point of this date, 0 within it.
    fn distance_days(&self, at: DateTime<Utc>) -> f64 {
        match *self {
            Mention::Span { start, end } => span_distance(at, start, end),
            Mention::EveryYear { month, day } => {
                let year = at.year();
                (year - 1..=year + 1)
                    .filter_map(|y| month_or_day(y, month, day))
                    .map(|(start, end)| span_distance(at, start, end))
                    .fold(f64::INFINITY, f64::min)
            }
        }
    }
}

fn span_distance(at: DateTime<Utc>, start: NaiveDate, end: NaiveDate) -> f64 {
    let secs = |d: NaiveDate| {
        d.and_hms_opt(0, 0, 0)
            .map_or(0, |t| t.and_utc().timestamp())
    };
    let t = at.timestamp();
    let (s, e) = (secs(start), secs(end));
    let outside = if t < s {
        s - t
    } else if t >= e {
        t - e
    } else {
        return 0.0;
    };
    // The end is not in the span: its first second is outside, though 0 seconds past it.
    (outside as f64 / 86_400.0).max(f64::MIN_POSITIVE)
}

/// `[start, end)` of a day, or of a month when `day` is `None`; `None` for a day the month
/// does not have (30 February).
fn month_or_day(year: i32, month: u32, day: Option<u32>) -> Option<(NaiveDate, NaiveDate)> {
    match day {
        Some(d) => {
            let start = NaiveDate::from_ymd_opt(year, month, d)?;
            Some((start, start.checked_add_days(Days::new(1))?))
        }
        None => {
            let start = NaiveDate::from_ymd_opt(year, month, 1)?;
            Some((start, start.checked_add_months(Months::new(1))?))
        }
    }
}

/// Lowercased words: letters and digits, with `-` kept inside a word so an ISO date stays
/// one (a hyphenated word is split again by [`read_at`] when it is not one).
fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !(c.is_alphanumeric() || c == '-'))
        .flat_map(|w| {
            let w = w.trim_matches('-');
            if w.is_empty() {
                return Vec::new();
            }
            if NaiveDate::parse_from_str(w, "%Y-%m-%d").is_ok() {
                return vec![w.to_lowercase()];
            }
            w.split('-')
                .filter(|p| !p.is_empty())
                .map(str::to_lowercase)
                .collect()
        })
}

const MONTHS: [&str; 12] = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
];

/// Words after which a bare month name is a time ("in May"), not another word ("may").
const BEFORE_A_MONTH: &[&str] = &[
    "in",
    "during",
    "since",
    "before",
    "after",
    "until",
    "till",
    "by",
    "of",
    "early",
    "late",
    "mid",
    "through",
    "throughout",
    "last",
    "this",
    "next",
    "from",
    "around",
];

/// The month a full name (`june`) or, when `abbreviated` is allowed, its first three
/// letters (`jun`, and `sept`) name.
fn month(word: &str, abbreviated: bool) -> Option<u32> {
    if let Some(i) = MONTHS.iter().position(|m| *m == word) {
        return Some(i as u32 + 1);
    }
    if !abbreviated {
        return None;
    }
    if word == "sept" {
        return Some(9);
    }
    (word.len() == 3)
        .then(|| MONTHS.iter().position(|m| m.starts_with(word)))
        .flatten()
        .map(|i| i as u32 + 1)
}

/// A day of a month: `13`, `13th`, `1st`, `2nd`, `3rd`.
fn day(word: &str) -> Option<u32> {
    let digits = word
        .strip_suffix("st")
        .or_else(|| word.strip_suffix("nd"))
        .or_else(|| word.strip_suffix("rd"))
        .or_else(|| word.strip_suffix("th"))
        .unwrap_or(word);
    if digits.is_empty() || digits.len() > 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let d: u32 = digits.parse().ok()?;
    (1..=31).contains(&d).then_some(d)
}

/// A year written out in four digits, 1900 to 2199.
fn year(word: &str) -> Option<i32> {
    if word.len() != 4 || !word.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let y: i32 = word.parse().ok()?;
    (1900..=2199).contains(&y).then_some(y)
}

fn dated(year: Option<i32>, month: u32, day: Option<u32>) -> Option<Mention> {
    match year {
        Some(y) => month_or_day(y, month, day).map(|(s, e)| Mention::span(s, e)),
        // A day a month never has (31 June) names no date.
        None => month_or_day(2000, month, day).map(|_| Mention::EveryYear { month, day }),
    }
}

/// The date that starts at word `i`, if any, and how many words it took.
fn read_at(words: &[String], i: usize, today: NaiveDate) -> (Option<Mention>, usize) {
    let at = |j: usize| words.get(j).map(String::as_str);
    let w = words[i].as_str();
    if let Ok(d) = NaiveDate::parse_from_str(w, "%Y-%m-%d") {
        return (
            d.checked_add_days(Days::new(1))
                .map(|next| Mention::span(d, next)),
            1,
        );
    }
    // A month name first: "October 13, 2023", "October 2023", "October 13", "in October".
    // An abbreviation counts only before a number ("Oct 13"): alone, "mar" and "may" are
    // words.
    let followed_by_number = at(i + 1).is_some_and(|n| day(n).is_some() || year(n).is_some());
    if let Some(m) = month(w, followed_by_number) {
        if let Some(d) = at(i + 1).and_then(day) {
            let y = at(i + 2).and_then(year);
            return (dated(y, m, Some(d)), if y.is_some() { 3 } else { 2 });
        }
        if let Some(y) = at(i + 1).and_then(year) {
            return (dated(Some(y), m, None), 2);
        }
        let after_preposition = i > 0 && BEFORE_A_MONTH.contains(&words[i - 1].as_str());
        return (after_preposition.then(|| dated(None, m, None)).flatten(), 1);
    }
    // "3 days ago", "a week ago", "two months ago".
    if let Some(mention) = ago(w, at(i + 1), at(i + 2), today) {
        return (Some(mention), 3);
    }
    // A day first: "13 October 2023", "3rd of June".
    if let Some(d) = day(w) {
        let of = usize::from(at(i + 1) == Some("of"));
        if let Some(m) = at(i + 1 + of).and_then(|n| month(n, true)) {
            let y = at(i + 2 + of).and_then(year);
            let used = 2 + of + usize::from(y.is_some());
            return (dated(y, m, Some(d)), used);
        }
        return (None, 1);
    }
    if let Some(y) = year(w) {
        let start = NaiveDate::from_ymd_opt(y, 1, 1);
        let end = NaiveDate::from_ymd_opt(y + 1, 1, 1);
        return (start.zip(end).map(|(s, e)| Mention::span(s, e)), 1);
    }
    relative(w, at(i + 1), today)
}

/// `<count> <unit> ago`: the day that many days, weeks, months or years before the
/// request's date (nearness then spreads it by the half-life). A count is 1 to 999 in
/// digits, or `a`, `an`, `one` to `twelve`.
fn ago(count: &str, unit: Option<&str>, ago: Option<&str>, today: NaiveDate) -> Option<Mention> {
    if ago != Some("ago") {
        return None;
    }
    const WORDS: [&str; 12] = [
        "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
        "twelve",
    ];
    let n: u32 = match count {
        "a" | "an" => 1,
        c if c.len() <= 3 && c.bytes().all(|b| b.is_ascii_digit()) => c.parse().ok()?,
        c => WORDS.iter().position(|w| *w == c)? as u32 + 1,
    };
    if n == 0 {
        return None;
    }
    let then = match unit?.trim_end_matches('s') {
        "day" => today.checked_sub_days(Days::new(n.into())),
        "week" => today.checked_sub_days(Days::new(7 * u64::from(n))),
        "month" => today.checked_sub_months(Months::new(n)),
        "year" => today.checked_sub_months(Months::new(12 * n)),
        _ => None,
    }?;
    Some(Mention::span(then, then.checked_add_days(Days::new(1))?))
}

/// `today`, `yesterday`, and `this` or `last` (`past`, `previous`) `week`, `month` or
/// `year`, against the request's own date. A week starts on Monday.
fn relative(w: &str, next: Option<&str>, today: NaiveDate) -> (Option<Mention>, usize) {
    let day_span = |d: NaiveDate| {
        d.checked_add_days(Days::new(1))
            .map(|e| Mention::span(d, e))
    };
    match w {
        "today" => return (day_span(today), 1),
        "yesterday" => return (today.checked_sub_days(Days::new(1)).and_then(day_span), 1),
        _ => {}
    }
    let back = match w {
        "this" => 0,
        "last" | "past" | "previous" => 1,
        _ => return (None, 1),
    };
    let mention = match next {
        Some("week") => {
            let monday =
                today.checked_sub_days(Days::new(today.weekday().num_days_from_monday().into()));
            monday
                .and_then(|m| m.checked_sub_days(Days::new(7 * back)))
                .and_then(|s| Some(Mention::span(s, s.checked_add_days(Days::new(7))?)))
        }
        Some("month") => NaiveDate::from_ymd_opt(today.year(), today.month(), 1)
            .and_then(|m| m.checked_sub_months(Months::new(back as u32)))
            .and_then(|s| Some(Mention::span(s, s.checked_add_months(Months::new(1))?))),
        Some("year") => {
            let y = today.year() - back as i32;
            NaiveDate::from_ymd_opt(y, 1, 1)
                .zip(NaiveDate::from_ymd_opt(y + 1, 1, 1))
                .map(|(s, e)| Mention::span(s, e))
        }
        _ => return (None, 1),
    };
    (mention, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> DateTime<Utc> {
        // A Wednesday.
        "2026-12-09T15:00:00Z".parse().unwrap()
    }

    fn day(y: i32, m: u32, d: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(y, m, d).unwrap()
    }

    fn span(s: NaiveDate, e: NaiveDate) -> Mention {
        Mention::Span { start: s, end: e }
    }

    fn parse(q: &str) -> Vec<Mention> {
        Mentions::parse(q, now()).0
    }

    #[test]
    fn absolute_dates_in_their_usual_forms() {
        let oct13 = span(day(2023, 10, 13), day(2023, 10, 14));
        for q in [
            "What painting did Melanie show to Caroline on October 13, 2023?",
            "shown on Oct 13th 2023",
            "on 13 October, 2023",
            "on the 13th of October 2023",
            "2023-10-13",
        ] {
            assert_eq!(parse(q), vec![oct13], "{q}");
        }
        assert_eq!(
            parse("What did Maria donate to a homeless shelter in December 2023?"),
            vec![span(day(2023, 12, 1), day(2024, 1, 1))]
        );
        assert_eq!(
            parse("How many times has Melanie gone to the beach in 2023?"),
            vec![span(day(2023, 1, 1), day(2024, 1, 1))]
        );
        assert_eq!(
            parse("When did Melanie go camping in June?"),
            vec![Mention::EveryYear {
                month: 6,
                day: None
            }]
        );
        assert_eq!(
            parse("lunch on June 5th"),
            vec![Mention::EveryYear {
                month: 6,
                day: Some(5)
            }]
        );
    }

    #[test]
    fn words_that_only_look_like_dates_are_not_dates() {
        for q in [
            "May I ask what she may have said?",
            "the march of the penguins",
            "she ran 13 miles and got 2nd place",
            "we sold 12345 units, then 99 more",
            "on 31 June",
            "on February 30, 2023",
            "mar a lago",
            "",
            "---",
        ] {
            assert_eq!(parse(q), vec![], "{q}");
        }
    }

    #[test]
    fn counted_times_ago_are_read_against_the_request() {
        let on = |d: NaiveDate| vec![span(d, d.succ_opt().unwrap())];
        assert_eq!(parse("what did we decide 3 days ago"), on(day(2026, 12, 6)));
        assert_eq!(parse("a week ago"), on(day(2026, 12, 2)));
        assert_eq!(parse("two months ago"), on(day(2026, 10, 9)));
        assert_eq!(parse("1 year ago"), on(day(2025, 12, 9)));
        for q in [
            "0 days ago",
            "3 days",
            "a week",
            "many days ago",
            "3 apples ago",
        ] {
            assert_eq!(parse(q), vec![], "{q}");
        }
    }

    #[test]
    fn relative_dates_are_read_against_the_request() {
        assert_eq!(
            parse("what did I decide yesterday"),
            vec![span(day(2026, 12, 8), day(2026, 12, 9))]
        );
        assert_eq!(
            parse("today"),
            vec![span(day(2026, 12, 9), day(2026, 12, 10))]
        );
        assert_eq!(
            parse("last week"),
            vec![span(day(2026, 11, 30), day(2026, 12, 7))]
        );
        assert_eq!(
            parse("this month"),
            vec![span(day(2026, 12, 1), day(2027, 1, 1))]
        );
        assert_eq!(
            parse("last month"),
            vec![span(day(2026, 11, 1), day(2026, 12, 1))]
        );
        assert_eq!(
            parse("past year"),
            vec![span(day(2025, 1, 1), day(2026, 1, 1))]
        );
        assert_eq!(parse("the last thing"), vec![]);
    }

    #[test]
    fn nearness_is_one_inside_and_halves_with_each_half_life_outside() {
        let m = Mentions::parse("in July 2023", now());
        let at = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
        assert_eq!(m.nearness(at("2023-07-15T12:00:00Z"), 7.0), 1.0);
        assert!((m.nearness(at("2023-08-08T00:00:00Z"), 7.0) - 0.5).abs() < 1e-6);
        assert!((m.nearness(at("2023-06-17T00:00:00Z"), 7.0) - 0.25).abs() < 1e-6);
        assert_eq!(
            Mentions::default().nearness(at("2023-07-15T12:00:00Z"), 7.0),
            0.0
        );
        // A half-life of 0 lifts only what lies within the date.
        assert_eq!(m.nearness(at("2023-07-31T23:59:59Z"), 0.0), 1.0);
        assert_eq!(m.nearness(at("2023-08-01T00:00:00Z"), 0.0), 0.0);
        // A month of any year is near in whichever year the memory is.
        let june = Mentions::parse("in June", now());
        assert_eq!(june.nearness(at("2019-06-30T23:00:00Z"), 7.0), 1.0);
        assert!((june.nearness(at("2021-01-01T00:00:00Z"), 7.0)) < 1e-6);
    }

    #[test]
    fn a_long_query_is_read_in_bounded_work() {
        let q = "in 2023 ".repeat(100_000);
        assert_eq!(parse(&q).len(), MAX_MENTIONS);
        let q = "x ".repeat(100_000) + "in 2023";
        assert_eq!(parse(&q), vec![]);
    }
}
