-- leasehold schema, version 9: progress a running handler records on its job.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

ALTER TABLE __SCHEMA__.jobs ADD COLUMN progress jsonb;

COMMENT ON COLUMN __SCHEMA__.jobs.progress IS
    'The latest progress or small state a handler recorded (JobContext::record_progress), fenced like every write of a running job; kept after the job ends. See src/store/progress.rs.';
