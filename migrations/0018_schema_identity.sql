-- leasehold schema, version 18: the schema's identity, minted once, the first part of
-- every effect key.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: an effect key was `<job id>/<step>`, and job ids start at 1 in every schema (and
-- again in a schema dropped and re-created). Two schemas, or two databases, whose jobs
-- charge through one payment gateway that deduplicates by idempotency key sent the same
-- key for their job 1: the gateway applied the first charge and answered the second
-- with the first one's receipt. A key is now `<schema identity>/<job id>/<step>`
-- (src/context.rs, EffectKey), the identity a random UUID minted here, once. It is data
-- in the schema, so it is the same on a standby after a failover and after a
-- pg_dump/restore of the schema (the same jobs, so the same keys), whatever the schema
-- or database is called there, and new in a schema created again. gen_random_uuid() is
-- built in from PostgreSQL 13.
CREATE TABLE __SCHEMA__.schema_identity (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    id         uuid        NOT NULL DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO __SCHEMA__.schema_identity DEFAULT VALUES;

COMMENT ON TABLE __SCHEMA__.schema_identity IS
    'The schema''s identity: one row, minted by migration 18 and never changed. Its id is the first part of every effect key, so keys of two schemas (or of a schema dropped and re-created) never meet in a shared effect store. Deleting or changing it changes every key: a retry would act again.';
COMMENT ON COLUMN __SCHEMA__.schema_identity.singleton IS 'Always true: the table holds one row.';
COMMENT ON COLUMN __SCHEMA__.schema_identity.id IS 'The identity, gen_random_uuid() at migration: effect keys are <id>/<job id>/<step>.';
COMMENT ON COLUMN __SCHEMA__.schema_identity.created_at IS 'Database time the identity was minted.';

-- The ledger's keys in the new form, so a retry of a job that recorded an effect before
-- this migration still finds it (and does not act again). Only keys this library made
-- (`<job id>/...` of their own job) are rewritten; a key a caller recorded through
-- Store::record_effect under a name of its own is left as it was. Keys were at most
-- 2,600 bytes, so with the 37 bytes added they still fit the primary key's index.
UPDATE __SCHEMA__.effects e
SET effect_key = (SELECT i.id::text FROM __SCHEMA__.schema_identity i) || '/' || e.effect_key
WHERE starts_with(e.effect_key, e.job_id::text || '/');

COMMENT ON COLUMN __SCHEMA__.effects.effect_key IS
    'Stable key: <schema identity>/<job id>/<step> (see schema_identity), never the generation, so every attempt of a step shares it and no other schema''s job has it.';
COMMENT ON COLUMN __SCHEMA__.jobs.id IS
    'Job id, assigned at enqueue; restarts at 1 in a new schema. With the schema''s identity (schema_identity), the stable part of every effect key.';
