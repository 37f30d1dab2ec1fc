//! What the templates show, prepared in Rust: every value a template prints is a
//! plain string or number that askama HTML-escapes, and every link is built here with
//! its query values percent-encoded, so no user-supplied text reaches the page raw.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::job::JobState;
use crate::store::JobFilter;

/// Characters of a payload or result shown before "see all".
pub(crate) const CLIP: usize = 4096;

/// What the layout needs on every page.
pub(crate) struct Frame {
    /// The mount path ("" at the root).
    pub(crate) base: String,
    pub(crate) title: String,
    /// Who may act here; `None` hides every button.
    pub(crate) who: Option<String>,
    /// The CSRF token for this browser's forms.
    pub(crate) csrf: String,
    /// A one-line message from the last action.
    pub(crate) flash: Option<String>,
}

impl Frame {
    /// A frame for a page built before `respond` fills it in.
    pub(crate) fn blank() -> Self {
        Frame {
            base: String::new(),
            title: String::new(),
            who: None,
            csrf: String::new(),
            flash: None,
        }
    }
}

/// A job filter as a form sends it: every field a string, empty when unset.
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct FilterForm {
    #[serde(default)]
    pub(crate) queue: String,
    #[serde(default)]
    pub(crate) state: String,
    #[serde(default)]
    pub(crate) kind: String,
    #[serde(default)]
    pub(crate) key: String,
    /// Seconds.
    #[serde(default)]
    pub(crate) older_than: String,
    /// The last id of the previous page.
    #[serde(default)]
    pub(crate) after: String,
}

fn set(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

impl FilterForm {
    /// The store's filter, or why a field is not understood.
    pub(crate) fn to_filter(&self, limit: i64) -> Result<JobFilter, String> {
        let state = match set(&self.state) {
            Some(s) => Some(JobState::parse(&s).ok_or_else(|| format!("unknown state {s:?}"))?),
            None => None,
        };
        let older_than = match set(&self.older_than) {
            Some(s) => {
                Some(Duration::from_secs(s.parse().map_err(|_| {
                    format!("older than: {s:?} is not a number of seconds")
                })?))
            }
            None => None,
        };
        let after = match set(&self.after) {
            Some(s) => Some(crate::JobId(
                s.parse()
                    .map_err(|_| format!("after: {s:?} is not a job id"))?,
            )),
            None => None,
        };
        Ok(JobFilter {
            queue: set(&self.queue),
            state,
            kind: set(&self.kind),
            key: set(&self.key),
            older_than,
            after,
            limit,
        })
    }

    /// The filter as a query string, with `after` replaced.
    pub(crate) fn query(&self, after: Option<i64>) -> String {
        let mut parts = Vec::new();
        for (name, value) in [
            ("queue", &self.queue),
            ("state", &self.state),
            ("kind", &self.kind),
            ("key", &self.key),
            ("older_than", &self.older_than),
        ] {
            if !value.trim().is_empty() {
                parts.push(format!("{name}={}", enc(value.trim())));
            }
        }
        if let Some(after) = after {
            parts.push(format!("after={after}"));
        }
        parts.join("&")
    }
}

/// Percent-encodes everything but the unreserved characters (RFC 3986).
pub(crate) fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A time for people: UTC to the second; "—" when there is none.
pub(crate) fn ts(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "—".into(), |t| t.format("%Y-%m-%d %H:%M:%S").to_string())
}

/// Seconds as "3h 2m", "2m 5s" or "4.2s".
pub(crate) fn age(secs: f64) -> String {
    let s = secs.max(0.0);
    if s < 60.0 {
        format!("{s:.1}s")
    } else if s < 3600.0 {
        format!("{}m {}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else {
        format!("{}h {}m", (s / 3600.0) as u64, ((s % 3600.0) / 60.0) as u64)
    }
}

/// A JSON value shown pretty-printed, clipped at [`CLIP`] characters unless `full`.
pub(crate) struct Clipped {
    pub(crate) text: String,
    pub(crate) shown: usize,
    pub(crate) total: usize,
    pub(crate) truncated: bool,
}

impl Clipped {
    pub(crate) fn json(value: Option<&serde_json::Value>, full: bool) -> Self {
        let text = match value {
            Some(v) => serde_json::to_string_pretty(v).unwrap_or_else(|e| e.to_string()),
            None => "—".into(),
        };
        Self::text(text, full)
    }

    pub(crate) fn text(text: String, full: bool) -> Self {
        let total = text.chars().count();
        if full || total <= CLIP {
            return Clipped {
                text,
                shown: total,
                total,
                truncated: false,
            };
        }
        Clipped {
            text: text.chars().take(CLIP).collect::<String>() + "…",
            shown: CLIP,
            total,
            truncated: true,
        }
    }
}

/// One line of text, clipped to `n` characters (an error in a table cell).
pub(crate) fn line(s: Option<&str>, n: usize) -> String {
    let s = s.unwrap_or("");
    let first = s.lines().next().unwrap_or("");
    if first.chars().count() > n || s.lines().nth(1).is_some() {
        first.chars().take(n).collect::<String>() + "…"
    } else {
        first.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_encode_what_could_break_out_of_a_query() {
        assert_eq!(enc("a b&c=d\"<"), "a%20b%26c%3Dd%22%3C");
        let form = FilterForm {
            key: "k&state=done".into(),
            ..Default::default()
        };
        assert_eq!(form.query(Some(5)), "key=k%26state%3Ddone&after=5");
    }

    #[test]
    fn long_payloads_are_clipped_unless_asked_for_all() {
        let long = "x".repeat(CLIP + 10);
        assert!(Clipped::text(long.clone(), false).truncated);
        assert_eq!(Clipped::text(long, true).shown, CLIP + 10);
    }
}
