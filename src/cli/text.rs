//! Plain text for people: aligned tables, ages, timestamps, and stored text made safe
//! for a terminal.

use std::fmt::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// Longest stored text (payload, error, detail) shown without `--full`.
pub(crate) const CUT: usize = 100;

/// Columns padded to their widest cell, two spaces apart; the last is not padded, so a
/// long error does not widen every line.
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        for (i, cell) in row.iter().enumerate() {
            if i == last {
                out += cell;
            } else {
                let _ = write!(out, "{cell:<w$}  ", w = widths[i]);
            }
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
    }
    out
}

/// `label  value` lines, the labels aligned.
pub(crate) fn fields(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    pairs
        .iter()
        .map(|(label, value)| format!("  {label:<width$}  {value}\n"))
        .collect()
}

/// A wait or an age to the second (`1h 2m 3s`); `-` for none.
pub(crate) fn age(secs: f64) -> String {
    if secs <= 0.0 {
        return "-".into();
    }
    humantime::format_duration(Duration::from_secs(secs.round() as u64)).to_string()
}

/// The age of a database timestamp, measured against `now` (the database's clock).
pub(crate) fn since(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    age((now - at).num_milliseconds() as f64 / 1000.0)
}

/// A timestamp to the second, in UTC; `-` for none.
pub(crate) fn when(at: Option<DateTime<Utc>>) -> String {
    at.map_or("-".into(), |t| t.format("%Y-%m-%d %H:%M:%SZ").to_string())
}

/// Stored text as one terminal-safe line: control characters (newlines, escape
/// sequences a payload could carry) are escaped, and unless `full` it is cut to
/// [`CUT`] characters with the rest counted.
pub(crate) fn shown(text: &str, full: bool) -> String {
    let escaped: String = text
        .chars()
        .flat_map(|c| {
            let keep = !c.is_control() || (full && c == '\n');
            let piece: Vec<char> = if keep {
                vec![c]
            } else {
                c.escape_default().collect()
            };
            piece
        })
        .collect();
    let total = escaped.chars().count();
    if full || total <= CUT {
        return escaped;
    }
    let head: String = escaped.chars().take(CUT).collect();
    format!("{head}… (+{} chars; --full shows all)", total - CUT)
}

/// An optional stored text, `-` for none.
pub(crate) fn shown_opt(text: Option<&str>, full: bool) -> String {
    text.map_or("-".into(), |t| shown(t, full))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_columns_line_up_whatever_the_cell_widths() {
        let out = table(
            &["ID", "STATE", "ERROR"],
            &[
                vec!["1".into(), "pending".into(), "-".into()],
                vec!["1234".into(), "dead".into(), "boom".into()],
            ],
        );
        assert_eq!(
            out,
            "ID    STATE    ERROR\n1     pending  -\n1234  dead     boom\n"
        );
    }

    #[test]
    fn stored_text_cannot_move_the_terminal_and_is_cut_unless_full() {
        assert_eq!(shown("a\nb\u{1b}[2J", false), "a\\nb\\u{1b}[2J");
        let long = "x".repeat(CUT + 5);
        let cut = shown(&long, false);
        assert!(cut.starts_with(&"x".repeat(CUT)));
        assert!(cut.ends_with("(+5 chars; --full shows all)"), "{cut}");
        assert_eq!(shown(&long, true), long);
        assert_eq!(shown("a\nb", true), "a\nb", "--full keeps line breaks");
    }

    #[test]
    fn ages_read_to_the_second_and_none_is_a_dash() {
        assert_eq!(age(0.0), "-");
        assert_eq!(age(3723.4), "1h 2m 3s");
    }
}
