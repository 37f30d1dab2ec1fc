//! The schema name: the only identifier leasehold puts into SQL text.
//!
//! Every value (queue, kind, key, payload, error text) is a bound parameter. The schema
//! name cannot be one, so it is validated here once and quoted here once; every
//! statement template says `{s}` where the quoted name goes.

use crate::error::{Error, Result};

/// A validated schema name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    name: String,
    quoted: String,
}

impl Schema {
    /// Accepts 1-63 characters of `a-z`, `0-9`, `_`, not starting with a digit.
    pub fn new(name: &str) -> Result<Self> {
        let ok = !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !name.as_bytes()[0].is_ascii_digit();
        if !ok {
            return Err(Error::InvalidSchema(name.to_string()));
        }
        Ok(Schema {
            name: name.to_string(),
            quoted: format!("\"{name}\""),
        })
    }

    /// The name as given (unquoted).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The quoted identifier, for SQL text.
    pub fn quoted(&self) -> &str {
        &self.quoted
    }

    /// A statement template with `{s}` replaced by the quoted schema.
    pub(crate) fn render(&self, template: &str) -> String {
        template.replace("{s}", &self.quoted)
    }

    /// The LISTEN/NOTIFY channel of this schema's enqueue wake-ups
    /// (`leasehold:<schema>:wake`). The payload is the queue name cut to 1000 characters
    /// (`left(queue, 1000)` in every NOTIFY): PostgreSQL refuses payloads of 8000 bytes or
    /// more, and a wake-up is only a hint, so a long queue name must not make its enqueue
    /// fail.
    pub fn channel(&self) -> String {
        channel_name(&self.name, "wake")
    }

    /// The channel on which a cancel of a running job reaches its owner at once
    /// (`leasehold:<schema>:cancel`). The payload is the job id. It is a hint: each
    /// process that runs that job asks the row (its next renewal, sent at once) and stops
    /// the handler only when the row records the cancel.
    pub fn cancel_channel(&self) -> String {
        channel_name(&self.name, "cancel")
    }

    /// The channel on which a pause reaches every scheduler at once
    /// (`leasehold:<schema>:pause`; the payload is the queue, cut like a wake-up's): each
    /// gives back the jobs of that queue it claimed ahead. A resume is announced on
    /// [`Schema::channel`], as new work.
    pub fn pause_channel(&self) -> String {
        channel_name(&self.name, "pause")
    }
}

/// `leasehold:<name>:<what>`, within PostgreSQL's 63-byte identifier limit (a NOTIFY on
/// a longer channel fails, which would make every enqueue fail).
///
/// Unambiguous for every pair of valid schema names: `:` and `#` cannot occur in a schema
/// name (see [`Schema::new`]), so the schema part ends at the last `:` and cannot be read
/// as part of another schema's channel (with `_` as the separator, schema `cancel_lh`'s
/// wake-ups were schema `lh`'s cancels). A long name keeps its first part and ends in
/// `#` and a hash of the whole, so it can equal no short name's channel either.
fn channel_name(name: &str, what: &str) -> String {
    const MAX: usize = 63;
    let full = format!("leasehold:{name}:{what}");
    if full.len() <= MAX {
        return full;
    }
    use sha2::{Digest, Sha256};
    let hash: String = Sha256::digest(name.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let fixed = "leasehold:".len() + 1 + hash.len() + 1 + what.len();
    // Schema names are ASCII, so any byte index is a char boundary.
    let keep = MAX - fixed;
    format!("leasehold:{}#{hash}:{what}", &name[..keep])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_that_could_inject_are_refused() {
        for bad in [
            "",
            "Jobs",
            "a-b",
            "x\"; drop table jobs;--",
            "1abc",
            &"a".repeat(64),
            "é",
        ] {
            assert!(Schema::new(bad).is_err(), "{bad:?} must be refused");
        }
        assert_eq!(
            Schema::new("leasehold_2").unwrap().quoted(),
            "\"leasehold_2\""
        );
    }

    #[test]
    fn channels_of_the_longest_schema_names_fit_postgres_identifiers() {
        let a = Schema::new(&format!("{}a", "s".repeat(62))).unwrap();
        let b = Schema::new(&format!("{}b", "s".repeat(62))).unwrap();
        for ch in [
            a.channel(),
            a.cancel_channel(),
            a.pause_channel(),
            b.channel(),
            b.cancel_channel(),
            b.pause_channel(),
        ] {
            assert!(ch.len() <= 63, "{ch} is {} bytes", ch.len());
        }
        assert_ne!(
            a.channel(),
            b.channel(),
            "two schemas must not share a channel"
        );
        assert_ne!(a.channel(), a.cancel_channel());
        assert_eq!(
            Schema::new("jobs").unwrap().channel(),
            "leasehold:jobs:wake"
        );
    }

    #[test]
    fn no_two_schemas_share_a_channel_whatever_their_names() {
        // The names that collided with `_` separators, the longest names, names that
        // end like a kind and names that look like another's hashed form.
        let long = |c: char| format!("{}{c}", "s".repeat(62));
        let names = [
            "lh".to_string(),
            "cancel_lh".to_string(),
            "pause_lh".to_string(),
            "lh_cancel".to_string(),
            "wake".to_string(),
            "cancel".to_string(),
            "pause".to_string(),
            long('a'),
            long('b'),
            "s".repeat(40),
            "s".repeat(46),
            "s".repeat(47),
            "s".repeat(63),
        ];
        let mut seen = std::collections::HashMap::new();
        for name in &names {
            let s = Schema::new(name).unwrap();
            for ch in [s.channel(), s.cancel_channel(), s.pause_channel()] {
                assert!(ch.len() <= 63, "{ch} is {} bytes", ch.len());
                if let Some(other) = seen.insert(ch.clone(), name.clone()) {
                    panic!("{ch} is a channel of both {other:?} and {name:?}");
                }
            }
        }
    }
}
