-- leasehold schema, version 20: retention whose pass costs what is due, never the table.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: the jobs pass compared `finished_at` with `clock_timestamp()`, which no index scan
-- can stop at, through an index that also holds the dead letters and the unique jobs
-- retention must keep: with 500,000 jobs finished an hour ago and nothing due under a
-- week's retention, every pass of every process read all 500,000 entries. The key pass
-- took every idle key row (open_jobs = 0, whether or not jobs of the key were left) and
-- asked of each "is any job of this key left" in a form no partial index answers, so it
-- read the jobs table once per idle key (25 s and more at 200,000 jobs), holding every
-- `key_floors` row FOR UPDATE meanwhile, which every keyed enqueue waits on.

-- The rows retention may delete, by the moment they become deletable: done and cancelled
-- jobs (never dead ones), at the later of their finish and the end of their unique window
-- (`greatest` skips a NULL window; a Forever job's 'infinity' is never reached). A pass
-- scans it up to its cutoff, a value computed once, and reads nothing it keeps.
CREATE INDEX jobs_prunable ON __SCHEMA__.jobs ((greatest(finished_at, unique_until)))
    WHERE state IN ('done', 'cancelled');

COMMENT ON INDEX __SCHEMA__.jobs_prunable IS
    'Done and cancelled jobs by the moment retention may count from (their finish, or their unique window''s end if later): the retention scan, bounded by its cutoff. See migrations/0020_bounded_retention.sql.';

-- Keys that may have no job left: the statement that deletes a key's jobs (retention's
-- jobs pass) names the key here, and the key pass reads only these, so it costs the keys
-- whose last jobs just went, not every idle key. Written and read by retention only: a
-- producer never touches it.
CREATE TABLE __SCHEMA__.idle_keys (
    queue   text NOT NULL,
    job_key text NOT NULL,
    PRIMARY KEY (queue, job_key)
);

COMMENT ON TABLE __SCHEMA__.idle_keys IS
    'Keys some of whose jobs retention deleted: the candidates of its key pass, which deletes the key row when no job of the key is left and forgets the key when one is. Retention''s own table (src/store/retention.rs); nothing else reads or writes it.';
COMMENT ON COLUMN __SCHEMA__.idle_keys.queue IS 'Queue of the key.';
COMMENT ON COLUMN __SCHEMA__.idle_keys.job_key IS 'The ordering key.';

-- Key rows idle now (no open job) are candidates once: those whose jobs are all gone go at
-- the next key pass, the others are forgotten until retention deletes their jobs.
INSERT INTO __SCHEMA__.idle_keys (queue, job_key)
SELECT queue, job_key FROM __SCHEMA__.job_keys WHERE open_jobs = 0;
