-- leasehold schema, version 13: live schedulers, each process's heartbeat, for
-- `leasehold status` and the dashboard; two indexes that keep the dashboard's job
-- listing off a scan of the history.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

CREATE TABLE __SCHEMA__.schedulers (
    owner text PRIMARY KEY,
    host text NOT NULL,
    pid integer NOT NULL,
    queues text[] NOT NULL,
    concurrency integer NOT NULL,
    heartbeat_secs float8 NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_seen timestamptz NOT NULL DEFAULT clock_timestamp()
);

COMMENT ON TABLE __SCHEMA__.schedulers IS
    'One row per running scheduler, written by its reaper every pass and deleted at its shutdown; a row not seen for three heartbeats is a process that died. Informational only: nothing in the protocol reads it. See src/store/schedulers.rs.';
COMMENT ON COLUMN __SCHEMA__.schedulers.owner IS 'The scheduler''s owner id, as in jobs.owner and the history.';
COMMENT ON COLUMN __SCHEMA__.schedulers.host IS 'The host name the process runs on.';
COMMENT ON COLUMN __SCHEMA__.schedulers.pid IS 'The process id on that host.';
COMMENT ON COLUMN __SCHEMA__.schedulers.queues IS 'The queues it claims from (Config::queues).';
COMMENT ON COLUMN __SCHEMA__.schedulers.concurrency IS 'Handlers it runs at once at most (Config::concurrency).';
COMMENT ON COLUMN __SCHEMA__.schedulers.heartbeat_secs IS 'Seconds between its heartbeats (Config::reaper_interval): it is live while last_seen is less than three of them old.';
COMMENT ON COLUMN __SCHEMA__.schedulers.started_at IS 'Its first heartbeat (database clock).';
COMMENT ON COLUMN __SCHEMA__.schedulers.last_seen IS 'Its latest heartbeat (database clock).';

-- The dead letters and held jobs by id: the jobs listing filtered by one of these states
-- walks this instead of the primary key past every done job (172 ms at 10^6 rows
-- without it). A row enters it only when it dies or is held.
CREATE INDEX jobs_parked_by_id ON __SCHEMA__.jobs (id) WHERE state IN ('dead', 'held');
-- A key's jobs in every state, history included, by id: the listing filtered by key
-- (215 ms at 10^6 rows without it). Unkeyed jobs are not in it; neither column changes
-- after the enqueue.
CREATE INDEX jobs_by_key ON __SCHEMA__.jobs (job_key, id) WHERE job_key IS NOT NULL;
