//! The schema's identity: a UUID minted once, by migration 18, and the first part of
//! every effect key (see [`crate::EffectKey`]).
//!
//! Job ids start at 1 in every schema, and again in a schema dropped and created again,
//! so a key of job id and step alone was the same for job 1 of two schemas: an effect
//! store both share (a payment gateway that deduplicates by idempotency key) took the
//! second job's effect for a repeat of the first's. The identity is data in the schema
//! (`schema_identity`, migrations/0018_schema_identity.sql), so it travels with the
//! jobs: the same on a standby after a failover and after a pg_dump/restore, whatever
//! the schema or database is called there; new in a schema created again.
//!
//! # Reads
//! A store reads the identity once: at [`Store::migrate`] (a scheduler's start), or at
//! its first effect when it was never migrated; every store made from it for another
//! pool ([`Store::with_pool`]) shares what it read. The ledger lookup that comes before
//! every effect ([`Store::effect_under`]) reads the identity again in the same
//! statement, so a schema created again under a running process is noticed before an
//! effect is made under the old identity, with no round trip of its own.

use std::sync::{Arc, Mutex};

use sqlx::Row;

use super::Store;
use crate::error::{Error, Result};

/// A schema's identity: the UUID in its `schema_identity` table, as lower-case
/// hyphenated text (36 characters), e.g. `0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a`, and the
/// first part of every [`EffectKey`](crate::EffectKey) of the schema's jobs.
///
/// Minted once, by migration 18 (`gen_random_uuid()`), and kept in the schema as data:
/// the same on a standby after a failover and after a pg_dump/restore of the schema
/// (the same jobs, so the same keys), whatever the schema or the database is called
/// there; a new one in a schema created again, whose job ids start at 1 again.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SchemaIdentity(String);

impl SchemaIdentity {
    /// The identity of `text`, if it is one: a UUID as PostgreSQL prints it (hex digits,
    /// lower case, hyphens after the 8th, 12th, 16th and 20th).
    pub fn parse(text: &str) -> Option<SchemaIdentity> {
        let b = text.as_bytes();
        let shaped = b.len() == 36
            && b.iter().enumerate().all(|(i, c)| match i {
                8 | 13 | 18 | 23 => *c == b'-',
                _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
            });
        shaped.then(|| SchemaIdentity(text.to_string()))
    }

    /// The identity as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for SchemaIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a store has read of its schema's identity, shared by the stores made from it.
pub(super) type Cached = Arc<Mutex<Option<SchemaIdentity>>>;

const READ: &str = "/* leasehold:schema_identity */ SELECT id::text AS id FROM {s}.schema_identity";

/// `undefined_table`: the schema has no `schema_identity` (older than version 18).
fn is_undefined_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01"))
}

impl Store {
    /// The identity of this store's schema ([`SchemaIdentity`]): read from the database
    /// by [`Store::migrate`] or, on a store that was never migrated, by the first call,
    /// then kept, and shared with the stores made from this one for other pools
    /// ([`Store::with_pool`]); so an effect costs no round trip for it. The ledger
    /// lookup before each effect reads it again in the same statement, and refuses the
    /// effect when it changed (the schema created again under a running process).
    /// Refused with [`Error::SchemaIdentity`] when the schema has none (older than
    /// version 18, or its row deleted).
    pub async fn schema_identity(&self) -> Result<SchemaIdentity> {
        if let Some(known) = self.cached_identity().lock().unwrap().clone() {
            return Ok(known);
        }
        self.read_schema_identity().await
    }

    /// Read the identity from the database and keep it (replacing what was kept).
    pub(super) async fn read_schema_identity(&self) -> Result<SchemaIdentity> {
        let row = sqlx::query(&self.schema().render(READ))
            .fetch_optional(self.db())
            .await
            .map_err(|e| match e {
                e if is_undefined_table(&e) => self.identity_error(
                    "it has no schema_identity table: it is older than version 18; run \
                     `leasehold migrate` (or `Store::migrate`) as the schema's owner",
                ),
                e => Error::Database(e),
            })?;
        let text: Option<String> = row.map(|r| r.try_get("id")).transpose()?;
        self.keep_identity(text.as_deref())
    }

    /// `found` (the identity a statement read, `None` when the row is missing) as the
    /// identity, kept for the next effect.
    pub(super) fn keep_identity(&self, found: Option<&str>) -> Result<SchemaIdentity> {
        let identity = match found {
            None => {
                return Err(self.identity_error(
                    "its schema_identity row is missing: restore it from a backup of the \
                     schema (a new identity would give every effect a new key, and retries \
                     would act again)",
                ))
            }
            Some(text) => SchemaIdentity::parse(text).ok_or_else(|| {
                self.identity_error(&format!("its schema_identity holds {text:?}, not a UUID"))
            })?,
        };
        *self.cached_identity().lock().unwrap() = Some(identity.clone());
        Ok(identity)
    }

    pub(super) fn identity_error(&self, reason: &str) -> Error {
        Error::SchemaIdentity {
            schema: self.schema().name().to_string(),
            reason: reason.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_uuid_as_postgres_prints_it_is_an_identity() {
        let id = "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a";
        assert_eq!(SchemaIdentity::parse(id).unwrap().as_str(), id);
        for bad in [
            "",
            "0b9f2c4e5d1a4e8b9c3f7a6d5e4b3c2a",
            "0B9F2C4E-5D1A-4E8B-9C3F-7A6D5E4B3C2A",
            "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2",
            "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/",
            "0b9f2c4e_5d1a-4e8b-9c3f-7a6d5e4b3c2a",
            "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2g",
        ] {
            assert!(SchemaIdentity::parse(bad).is_none(), "{bad:?}");
        }
    }
}
