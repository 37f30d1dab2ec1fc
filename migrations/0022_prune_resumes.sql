-- leasehold schema, version 22: retention's jobs scan resumes where the previous pass ended.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: a deleted row's index entries stay until no snapshot can see the row. While one
-- snapshot is open (a backup's `pg_dump`, a long report), every pass walked again the
-- entries of every job retention had deleted since it began: 30,000 deletions meant 30,000
-- entries read by each pass of each process, with nothing due. A pass now resumes the scan
-- after the last job this process's previous pass deleted, which needs a total order: the
-- moment retention may count from, then the id (a batch of jobs completed in one
-- transaction shares its `finished_at`). See src/store/retention.rs.
DROP INDEX __SCHEMA__.jobs_prunable;
CREATE INDEX jobs_prunable ON __SCHEMA__.jobs ((greatest(finished_at, unique_until)), id)
    WHERE state IN ('done', 'cancelled');

COMMENT ON INDEX __SCHEMA__.jobs_prunable IS
    'Done and cancelled jobs by the moment retention may count from (their finish, or their unique window''s end if later), then id: the retention scan, bounded by its cutoff and resumed after the last job deleted. See migrations/0022_prune_resumes.sql.';
