-- leasehold schema, version 12: the reaper's index no longer matches the fenced writes.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: every fenced write says `state = 'running'` (complete, fail, release, renew,
-- progress, effects), and the reaper's index was partial on exactly that predicate. On a
-- table whose statistics say it holds few running jobs (never analyzed, or analyzed while
-- jobs were pending) the planner chose that index for a batch of completions and walked
-- every running entry, and the entries of every job that had finished since the last
-- VACUUM, instead of looking the batch up by id: 3,540 buffers for 46 completions with
-- 50,000 running rows, against 438 by id. Keyed on the lease's presence instead, the
-- index serves only statements that bound `lease_until` (the reaper's, and the running
-- count of the queue statistics). A running job always has a lease (the jobs table's
-- CHECK), and every way out of running clears it, so it holds the same rows.
-- The index is built before the old one is dropped; on a large table the build blocks
-- writes to jobs for as long as one pass over the table takes.
CREATE INDEX jobs_leased ON __SCHEMA__.jobs (lease_until) WHERE lease_until IS NOT NULL;
DROP INDEX __SCHEMA__.jobs_running_by_lease;

COMMENT ON INDEX __SCHEMA__.jobs_leased IS
    'Leased (running) jobs by lease deadline: the reaper''s scan. Not keyed on state, so fenced writes look jobs up by id. See migrations/0012_leased_index.sql.';
