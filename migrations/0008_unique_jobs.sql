-- leasehold schema, version 8: unique jobs.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- A unique job carries its key and, for the period and forever scopes, the end of the
-- window it is unique in ('infinity' for ever). Columns without defaults: no rewrite.
ALTER TABLE __SCHEMA__.jobs ADD COLUMN unique_key text, ADD COLUMN unique_until timestamptz;

-- The database enforces uniqueness; an enqueue also takes a lock per unique key while it
-- looks for an existing job, so a duplicate is answered with that job's id, not an error.
-- While open: only the open states are in the index, so a finished job frees its key.
CREATE UNIQUE INDEX jobs_unique_open ON __SCHEMA__.jobs (kind, unique_key)
    WHERE unique_key IS NOT NULL AND unique_until IS NULL
      AND state IN ('pending', 'waiting', 'running', 'held');
-- Per window, or for ever: whatever the state.
CREATE UNIQUE INDEX jobs_unique_window ON __SCHEMA__.jobs (kind, unique_key, unique_until)
    WHERE unique_key IS NOT NULL AND unique_until IS NOT NULL;

COMMENT ON COLUMN __SCHEMA__.jobs.unique_key IS
    'NewJob::unique: no other job of this kind with this key in the scope (see unique_until). NULL: not unique. See src/store/unique.rs.';
COMMENT ON COLUMN __SCHEMA__.jobs.unique_until IS
    'The end of the window the unique key holds in: a period''s end, or infinity (for ever). NULL with a unique_key: unique while open. Retention keeps the row until this passes.';
