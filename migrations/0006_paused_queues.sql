-- leasehold schema, version 6: pausing a queue across every process.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- A queue with a row here is paused: no claim takes its jobs (the claim statements
-- filter their queue lists through this table), jobs already running finish, and
-- schedulers give back the jobs of it they claimed ahead. Resuming deletes the row.
CREATE TABLE __SCHEMA__.paused_queues (
    queue text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Who paused it, as the caller said (an operator, a deploy script); free text.
    paused_by text
);

COMMENT ON TABLE __SCHEMA__.paused_queues IS
    'Queues paused by an operator: no claim takes their jobs until the row is deleted (resume). See src/store/pause.rs.';
COMMENT ON COLUMN __SCHEMA__.paused_queues.queue IS 'The paused queue.';
COMMENT ON COLUMN __SCHEMA__.paused_queues.paused_at IS 'When it was paused (database clock).';
COMMENT ON COLUMN __SCHEMA__.paused_queues.paused_by IS 'Who paused it and why, as the pausing call said (free text).';
