-- leasehold schema, version 14: a key's history indexed once per job, not once per version.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: version 13's jobs_by_key held every version of every keyed row. A state change is
-- never a HOT update (state is in the partial indexes' predicates), so each of a keyed
-- job's four versions (enqueued, promoted, claimed, done) added an entry: measured with
-- the bench's keyed drain (10,000 keys x 10 jobs), dropping it took 6,431 to 7,043
-- jobs/s and the hot key from 422 to 476 jobs/s. The listing filtered by key reads the
-- open jobs of the key from the indexes the claim and the promotion already keep
-- (jobs_open_by_key, jobs_waiting_by_key) and its history from this one, which a job
-- enters once, when it ends done or cancelled (dead jobs are in jobs_open_by_key: they
-- may block their key).
-- The index is built before the old one is dropped; on a large table the build blocks
-- writes to jobs for as long as one pass over the table takes.
CREATE INDEX jobs_ended_by_key ON __SCHEMA__.jobs (job_key, id)
    WHERE job_key IS NOT NULL AND state IN ('done', 'cancelled');
DROP INDEX __SCHEMA__.jobs_by_key;

COMMENT ON INDEX __SCHEMA__.jobs_ended_by_key IS
    'A key''s done and cancelled jobs by id: the history half of the listing filtered by key. See migrations/0014_ended_by_key.sql.';
