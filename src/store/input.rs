//! What the store refuses before it writes: the one place that knows what PostgreSQL
//! can store and what leasehold can read back. Every write path calls these checks
//! before its first statement, so a refusal writes nothing and, inside the caller's
//! transaction, sends nothing that could abort it.
//!
//! # Names
//!
//! Queue, kind, key, unique key and effect key are text: any string is stored as it is
//! (always a bound parameter) except the empty string, which is not a name (a job
//! without a key has `None`, and a form or a command line cannot tell an empty field
//! from an unset one), and NUL, which PostgreSQL text cannot hold.
//!
//! # JSON values
//!
//! A payload, a result, progress and an effect outcome are refused when they hold a NUL
//! (in a string or an object key: jsonb refuses `\u0000`) or nest arrays and objects
//! deeper than [`MAX_PAYLOAD_DEPTH`] levels: jsonb would store that, but serde_json,
//! which every reader uses (the claim, `Store::job`, the listings, the dashboard, the
//! CLI, the effect ledger), refuses to read past 128. The schema refuses the same depth
//! in a result, progress and an effect outcome written around these checks (migration
//! 17); a payload written so is read per job, with its reason. Then each has its size
//! limit. The value is walked with an explicit stack before anything serializes it:
//! serde_json's serializer recurses, and a value 10,000 levels deep would overflow the
//! stack of the thread that serialized it.
//!
//! # Indexed text
//!
//! PostgreSQL refuses an index entry larger than [`INDEX_ENTRY_LIMIT`] bytes, after it
//! compressed each long value in the entry. Queue and key share entries (the key's
//! row, its order), as do kind and unique key, so up to [`INDEXED_TEXT_ALWAYS_FITS`]
//! bytes of each pair always fit. Longer text fits only if it compresses enough, which
//! only the database can tell: such a write runs in a savepoint when it is inside the
//! caller's transaction (so a refusal leaves that transaction usable), and the
//! database's refusal comes back as [`Error::InvalidInput`] naming the field and the
//! limit. An effect key is only ever the job's effect identity (36 bytes), its id and a
//! step name chosen in code, and its refusal would come after the effect happened, so
//! it must fit for sure: at most [`INDEXED_TEXT_ALWAYS_FITS`] bytes, the whole key.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::job::NewJob;

/// Deepest nesting of arrays and objects any stored JSON value may have (payload,
/// result, progress, effect outcome). jsonb stores any depth, but serde_json refuses to
/// read past 128 levels, so a deeper value could be stored and then never be read back
/// (or shown to an operator). Refused when written, by the Rust calls and by the schema.
pub const MAX_PAYLOAD_DEPTH: usize = 127;

/// Serialize a user's value (a typed payload, progress, a handler's output, an effect's
/// outcome) to JSON, refusing nesting deeper than [`MAX_PAYLOAD_DEPTH`] *while* it
/// serializes. `serde_json::to_value` recurses once per level, so a value 10,000 levels
/// deep would overflow the thread's stack (and take the whole process down) before any
/// walk of the result could refuse it; here the serializer stops at the first level too
/// many. The text is then parsed back into a value (at most 127 levels, which serde_json
/// reads). The error says why, for the caller to wrap.
pub(crate) fn to_json<T: serde::Serialize + ?Sized>(
    value: &T,
) -> std::result::Result<Value, String> {
    let mut text = Vec::with_capacity(64);
    let mut ser = serde_json::Serializer::with_formatter(&mut text, DepthBound(0));
    value.serialize(&mut ser).map_err(|e| e.to_string())?;
    serde_json::from_slice(&text).map_err(|e| e.to_string())
}

/// serde_json's compact output, refusing to open the level past [`MAX_PAYLOAD_DEPTH`].
struct DepthBound(usize);

impl DepthBound {
    fn open<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.0 += 1;
        if self.0 > MAX_PAYLOAD_DEPTH {
            return Err(std::io::Error::other(format!(
                "nested deeper than {MAX_PAYLOAD_DEPTH} levels of arrays and objects, the most serde_json reads back"
            )));
        }
        w.write_all(bracket)
    }

    fn close<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.0 -= 1;
        w.write_all(bracket)
    }
}

impl serde_json::ser::Formatter for DepthBound {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
}

/// PostgreSQL's largest b-tree index entry, in bytes (8 kB pages), after compression.
pub const INDEX_ENTRY_LIMIT: usize = 2704;

/// Text of an index entry up to this many bytes always fits in it, however little it
/// compresses: queue and key together, kind and unique key together, an effect key.
/// The rest of [`INDEX_ENTRY_LIMIT`] is the entry's headers and other columns.
pub const INDEXED_TEXT_ALWAYS_FITS: usize = 2600;

/// Refuse what PostgreSQL text cannot store, and the empty string. Everything else
/// (quotes, SQL, non-ASCII, long strings) is stored unchanged: values are always bound
/// parameters.
pub(crate) fn check_name(field: &'static str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::InvalidInput {
            field,
            reason: "must not be empty".into(),
        });
    }
    if value.contains('\0') {
        return Err(Error::InvalidInput {
            field,
            reason: "contains a NUL byte, which PostgreSQL text cannot store".into(),
        });
    }
    Ok(())
}

/// What PostgreSQL or serde_json cannot hold in a JSON value: a NUL in a string or an
/// object key (jsonb refuses `\u0000`), or nesting deeper than `max_depth` (serde_json
/// refuses to read it back). Walks the value with an explicit stack, so a hostile
/// value cannot overflow this thread's stack.
pub(crate) fn unstorable_json(value: &Value, max_depth: usize) -> Option<String> {
    let too_deep = || {
        format!("nested deeper than {max_depth} levels of arrays and objects, the most serde_json reads back")
    };
    let mut stack: Vec<(&Value, usize)> = vec![(value, 0)];
    while let Some((v, depth)) = stack.pop() {
        match v {
            Value::String(s) if s.contains('\0') => {
                return Some(
                    "a string contains NUL (\\u0000), which PostgreSQL jsonb cannot store".into(),
                )
            }
            Value::Array(items) => {
                if depth + 1 > max_depth {
                    return Some(too_deep());
                }
                stack.extend(items.iter().map(|i| (i, depth + 1)));
            }
            Value::Object(map) => {
                if depth + 1 > max_depth {
                    return Some(too_deep());
                }
                for (k, item) in map {
                    if k.contains('\0') {
                        return Some(
                            "an object key contains NUL (\\u0000), which PostgreSQL jsonb cannot store"
                                .into(),
                        );
                    }
                    stack.push((item, depth + 1));
                }
            }
            _ => {}
        }
    }
    None
}

/// The size limit of a JSON field, as its refusal names it.
pub(crate) struct JsonLimit {
    /// Bytes of the JSON encoding.
    pub bytes: usize,
    /// Where the limit is set (`store.max_result_bytes`, ...).
    pub name: &'static str,
}

/// The checks of a result, progress or effect outcome: storable and readable (see
/// [`unstorable_json`]), then at most `limit` bytes of JSON. Returns the size.
pub(crate) fn check_json(field: &'static str, value: &Value, limit: &JsonLimit) -> Result<usize> {
    if let Some(reason) = unstorable_json(value, MAX_PAYLOAD_DEPTH) {
        return Err(Error::InvalidInput { field, reason });
    }
    let mut size = ByteCount(0);
    serde_json::to_writer(&mut size, value).map_err(|e| Error::InvalidInput {
        field,
        reason: format!("cannot be encoded as JSON: {e}"),
    })?;
    if size.0 > limit.bytes {
        return Err(Error::InvalidInput {
            field,
            reason: format!(
                "{} bytes of JSON is more than the limit of {} bytes ({})",
                size.0, limit.bytes, limit.name
            ),
        });
    }
    Ok(size.0)
}

/// Counts what is written to it, so a value's size is known without a copy.
struct ByteCount(usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An effect key the ledger can record for sure: named (see [`check_name`]) and at most
/// [`INDEXED_TEXT_ALWAYS_FITS`] bytes, since it is checked before the effect happens
/// and a refusal after it would make a retry act again.
pub(crate) fn check_effect_key(key: &str) -> Result<()> {
    check_name("effect key", key)?;
    if key.len() > INDEXED_TEXT_ALWAYS_FITS {
        return Err(Error::InvalidInput {
            field: "effect key",
            reason: format!(
                "{} bytes is more than the {INDEXED_TEXT_ALWAYS_FITS} bytes an effect key may take \
                 (it is indexed; PostgreSQL's index entries hold {INDEX_ENTRY_LIMIT}); use a \
                 shorter step name",
                key.len()
            ),
        });
    }
    Ok(())
}

/// The longest indexed text of a batch of jobs, by field, and whether any of its index
/// entries may be over the limit: what a refusal by the database is put down to.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IndexedText {
    queue: usize,
    key: usize,
    kind: usize,
    unique_key: usize,
    /// Some index entry of the batch holds more than [`INDEXED_TEXT_ALWAYS_FITS`] bytes
    /// of text: the database may refuse it.
    long: bool,
}

impl IndexedText {
    /// The indexed text of `jobs`. A kind is indexed only with a unique key.
    pub(crate) fn of<'a>(jobs: impl IntoIterator<Item = &'a NewJob>) -> Self {
        let mut t = IndexedText::default();
        for job in jobs {
            let queue = job.queue_name().len();
            let key = job.key.as_ref().map_or(0, String::len);
            let unique = job.unique.as_ref().map(|u| (job.kind.len(), u.key.len()));
            t.queue = t.queue.max(queue);
            t.key = t.key.max(key);
            if let Some((kind, unique_key)) = unique {
                t.kind = t.kind.max(kind);
                t.unique_key = t.unique_key.max(unique_key);
            }
            t.long |= queue + key > INDEXED_TEXT_ALWAYS_FITS
                || unique.is_some_and(|(k, u)| k + u > INDEXED_TEXT_ALWAYS_FITS);
        }
        t
    }

    /// The indexed text of a queue name alone (a pause).
    pub(crate) fn of_queue(queue: &str) -> Self {
        IndexedText {
            queue: queue.len(),
            long: queue.len() > INDEXED_TEXT_ALWAYS_FITS,
            ..IndexedText::default()
        }
    }

    /// The database may refuse an index entry of this batch.
    pub(crate) fn may_be_refused(&self) -> bool {
        self.long
    }

    /// `e` as the refusal of the field it is down to, when it is PostgreSQL refusing an
    /// index entry as too large; any other error as it is.
    pub(crate) fn refusal(&self, e: Error) -> Error {
        let Error::Database(sqlx::Error::Database(db)) = &e else {
            return e;
        };
        if db.code().as_deref() != Some("54000") || !db.message().starts_with("index row") {
            return e;
        }
        // The index names its columns; without a name (an entry past 8 kB is refused
        // before any index is named), any of them.
        let fields: &[&'static str] = match db.constraint().unwrap_or_default() {
            "job_keys_pkey" | "jobs_open_by_key" | "jobs_waiting_by_key" => &["key", "queue"],
            "jobs_by_key" | "jobs_ended_by_key" => &["key"],
            "jobs_claimable_by_queue" | "jobs_parked_by_queue" | "paused_queues_pkey" => &["queue"],
            "jobs_unique_open" | "jobs_unique_window" => &["unique key", "kind"],
            _ => &["key", "queue", "unique key", "kind"],
        };
        let (field, bytes) = fields
            .iter()
            .map(|&f| (f, self.bytes_of(f)))
            .max_by_key(|&(_, bytes)| bytes)
            .unwrap_or(("key", 0));
        Error::InvalidInput {
            field,
            reason: format!(
                "{bytes} bytes does not fit in an index entry, which holds at most \
                 {INDEX_ENTRY_LIMIT} bytes after compression (up to {INDEXED_TEXT_ALWAYS_FITS} \
                 bytes of queue and key together, or of kind and unique key together, always \
                 fit); PostgreSQL refused it: {}; nothing was written",
                db.message()
            ),
        }
    }

    fn bytes_of(&self, field: &str) -> usize {
        match field {
            "queue" => self.queue,
            "key" => self.key,
            "kind" => self.kind,
            _ => self.unique_key,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_too_deep_is_refused_while_it_serializes_not_after() {
        // Run on a small stack: a recursion per level of 10,000 would overflow it.
        let refused = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(|| {
                let v = deep(10_000);
                let r = to_json(&v);
                std::mem::forget(v); // dropping it recurses too
                r
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(refused.unwrap_err().contains("127 levels"));
        assert!(to_json(&deep(127)).is_ok());
        assert!(to_json(&deep(128)).is_err());
        assert_eq!(
            to_json(&serde_json::json!({"a": [1, "x"]})).unwrap(),
            serde_json::json!({"a": [1, "x"]})
        );
    }

    fn deep(levels: usize) -> Value {
        let mut v = serde_json::json!(1);
        for _ in 0..levels {
            v = Value::Array(vec![v]);
        }
        v
    }

    #[test]
    fn depth_is_refused_past_the_limit_and_before_anything_recurses() {
        assert_eq!(
            unstorable_json(&deep(MAX_PAYLOAD_DEPTH), MAX_PAYLOAD_DEPTH),
            None
        );
        let reason = unstorable_json(&deep(MAX_PAYLOAD_DEPTH + 1), MAX_PAYLOAD_DEPTH).unwrap();
        assert!(reason.contains("127"), "{reason}");
        // serde_json reads exactly what is accepted, and nothing deeper.
        let text = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(serde_json::from_str::<Value>(&text(MAX_PAYLOAD_DEPTH)).is_ok());
        assert!(serde_json::from_str::<Value>(&text(MAX_PAYLOAD_DEPTH + 1)).is_err());
        // 10,000 levels: refused by the walk, never serialized.
        let limit = JsonLimit {
            bytes: 1 << 20,
            name: "test",
        };
        let err = check_json("result", &deep(10_000), &limit).unwrap_err();
        assert!(err.to_string().contains("127"), "{err}");
    }

    #[test]
    fn effect_keys_must_fit_for_sure() {
        assert!(check_effect_key(&"k".repeat(INDEXED_TEXT_ALWAYS_FITS)).is_ok());
        assert!(check_effect_key(&"k".repeat(INDEXED_TEXT_ALWAYS_FITS + 1)).is_err());
        assert!(check_effect_key("1/a\0b").is_err());
    }
}
