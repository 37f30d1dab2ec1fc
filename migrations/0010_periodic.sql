-- leasehold schema, version 10: periodic jobs, each fire time enqueued once across every
-- process without a leader.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

CREATE TABLE __SCHEMA__.periodic_schedules (
    name text PRIMARY KEY,
    spec text NOT NULL,
    last_fire_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE __SCHEMA__.periodic_fires (
    name text NOT NULL,
    fire_at timestamptz NOT NULL,
    job_id bigint,
    late boolean NOT NULL DEFAULT false,
    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (name, fire_at)
);
CREATE INDEX periodic_fires_by_time ON __SCHEMA__.periodic_fires (enqueued_at);

COMMENT ON TABLE __SCHEMA__.periodic_schedules IS
    'Periodic schedules as registered in code (SchedulerBuilder::periodic): the process that fires one locks its row. See src/store/periodic.rs.';
COMMENT ON COLUMN __SCHEMA__.periodic_schedules.spec IS 'The schedule as text (cron expression and time zone, or interval); a change takes effect at its next fire time.';
COMMENT ON COLUMN __SCHEMA__.periodic_schedules.last_fire_at IS 'The latest fire time handled (enqueued, or skipped by the catch-up policy); the first registration sets it to its own time, so nothing before it fires.';
COMMENT ON TABLE __SCHEMA__.periodic_fires IS
    'One row per fire time enqueued: its primary key is what makes a fire time enqueue once, whatever the number of processes.';
COMMENT ON COLUMN __SCHEMA__.periodic_fires.late IS 'Enqueued by the catch-up policy after its time had passed by more than the grace (a process was down).';
COMMENT ON COLUMN __SCHEMA__.periodic_schedules.name IS 'The schedule''s name in code (Periodic::cron / Periodic::every): how every process recognizes it.';
COMMENT ON COLUMN __SCHEMA__.periodic_schedules.updated_at IS 'When the row was registered, or its spec last changed.';
COMMENT ON COLUMN __SCHEMA__.periodic_fires.name IS 'The schedule.';
COMMENT ON COLUMN __SCHEMA__.periodic_fires.fire_at IS 'The fire time; also the run-at time of its job.';
COMMENT ON COLUMN __SCHEMA__.periodic_fires.job_id IS 'The job enqueued for this fire time (no foreign key: retention may prune the job, and this row stays as the record that the time fired).';
COMMENT ON COLUMN __SCHEMA__.periodic_fires.enqueued_at IS 'When the fire was enqueued (database clock).';
