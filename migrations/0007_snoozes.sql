-- leasehold schema, version 7: snoozes, a handler's "not yet" that spends no attempt.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- A column with a constant default: no table rewrite (PostgreSQL 11 and later).
ALTER TABLE __SCHEMA__.jobs ADD COLUMN snoozes integer NOT NULL DEFAULT 0;

COMMENT ON COLUMN __SCHEMA__.jobs.snoozes IS
    'Times a handler snoozed this job (JobError::snooze): each put it back to pending with its delay and gave back the attempt. Past the kind''s MAX_SNOOZES a snooze counts as a failed attempt. See src/store/fail.rs.';
