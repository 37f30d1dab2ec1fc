-- leasehold schema, version 19: the specs of each periodic schedule, versioned, so two
-- builds with different specs for one schedule (a rolling deploy) fire one spec's times,
-- each once.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: each build rewrote the stored spec to its own when it differed (moving
-- last_fire_at to now) and returned without firing, so an old and a new build side by
-- side kept rewriting each other's spec and nothing fired. Now each spec gets a version
-- when first seen (one more than any before), each look records that its build still
-- keeps it, and every build fires the times of the highest version kept by a build seen
-- lately (src/store/periodic.rs, src/periodic/mod.rs "Rolling deploys").
CREATE TABLE __SCHEMA__.periodic_specs (
    name text NOT NULL,
    spec text NOT NULL,
    version bigint NOT NULL,
    first_seen_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    kept_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (name, spec),
    UNIQUE (name, version)
);

ALTER TABLE __SCHEMA__.periodic_schedules ADD COLUMN version bigint NOT NULL DEFAULT 1;

-- The spec each schedule has now is its first version.
INSERT INTO __SCHEMA__.periodic_specs (name, spec, version)
SELECT name, spec, 1 FROM __SCHEMA__.periodic_schedules;

COMMENT ON TABLE __SCHEMA__.periodic_specs IS
    'Every spec a periodic schedule was registered with, by build: the schedule fires the times of the highest version kept lately (kept_at within periodic::SPEC_KEPT_FOR). Written under the schedule''s row lock. See src/store/periodic.rs.';
COMMENT ON COLUMN __SCHEMA__.periodic_specs.name IS 'The schedule (periodic_schedules.name).';
COMMENT ON COLUMN __SCHEMA__.periodic_specs.spec IS 'The spec as text: `cron <expression> <zone>` or `every <interval>` (Periodic::spec).';
COMMENT ON COLUMN __SCHEMA__.periodic_specs.version IS 'One more than any version of the schedule before it, given when the spec was first seen: the newest build''s spec has the highest.';
COMMENT ON COLUMN __SCHEMA__.periodic_specs.first_seen_at IS 'When a build first registered this spec (database clock).';
COMMENT ON COLUMN __SCHEMA__.periodic_specs.kept_at IS 'The latest look by a build that registers this spec (database clock): a spec not kept for periodic::SPEC_KEPT_FOR belongs to builds that are gone.';
COMMENT ON COLUMN __SCHEMA__.periodic_schedules.version IS 'The version (periodic_specs.version) of spec, the spec whose times the schedule fires.';
COMMENT ON COLUMN __SCHEMA__.periodic_schedules.spec IS 'The spec whose times the schedule fires: the highest version in periodic_specs kept lately. A change goes on from last_fire_at.';
