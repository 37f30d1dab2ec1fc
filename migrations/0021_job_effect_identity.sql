-- leasehold schema, version 21: every job's own effect identity, the first part of its
-- effect keys; the schema's identity (version 18) is dropped.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: an effect key was `<schema identity>/<job id>/<step>`. Job ids come from the
-- schema's sequence, and a schema restored from an older dump rewinds it: the jobs
-- enqueued after the restore took the ids (so the keys) of jobs enqueued after the dump,
-- whose effects an effect store (a payment gateway deduplicating by idempotency key) had
-- already applied; it answered the new job's charge with the old one's receipt. And a
-- process that read the schema's identity kept it after the schema was created again.
-- Now every job carries its own identity, a random UUID minted by the insert, and its
-- keys are `<job's identity>/<job id>/<step>` (src/context.rs, EffectKey): no other job
-- of any schema, database or restore has it, and it comes with the claimed row, so no
-- process keeps one of its own. A job restored from a dump keeps its identity (the same
-- job, so the same keys: a retry gets the recorded outcome).
--
-- The claim, and the promotion that claims a key's next job in the transaction that ends
-- its head, return the identity with the job. A changed result type needs the functions
-- made again; the older `claim` keeps its own columns, for a scheduler of a build older than
-- version 16 still running during a rolling deploy.
DROP FUNCTION __SCHEMA__.promote(text[], text[], boolean[], text, text[], float8, boolean, text);
DROP FUNCTION __SCHEMA__.complete_keyed(bigint[], bigint[], jsonb[], text[], text[], boolean[], boolean, text, text[], float8, boolean, text);
DROP FUNCTION __SCHEMA__.claim(text[], text[], integer, bigint, boolean, text, timestamptz, float8, boolean);
DROP FUNCTION __SCHEMA__.claim_capped(text[], text[], integer, bigint, boolean, text, timestamptz, float8, boolean, text[], integer[]);

-- The jobs already in the table get the schema's identity, so their keys, and the ledger
-- rows recorded under them, stay as they were (a constant default: no table rewrite).
DO $$
BEGIN
    EXECUTE format('ALTER TABLE __SCHEMA__.jobs ADD COLUMN effect_identity uuid NOT NULL DEFAULT %L',
                   (SELECT i.id FROM __SCHEMA__.schema_identity i));
END
$$;
ALTER TABLE __SCHEMA__.jobs ALTER COLUMN effect_identity SET DEFAULT gen_random_uuid();
COMMENT ON COLUMN __SCHEMA__.jobs.effect_identity IS
    'The job''s identity for effect keys (<effect_identity>/<id>/<step>): random, minted at enqueue, never changed; unique to this job across schemas, databases and restores.';
COMMENT ON COLUMN __SCHEMA__.jobs.id IS
    'Job id, assigned at enqueue; restarts at 1 in a new schema and rewinds in a restored one. Effect keys carry effect_identity before it for that reason.';
COMMENT ON COLUMN __SCHEMA__.effects.effect_key IS
    'Stable key: <job effect_identity>/<job id>/<step> for keys leasehold makes, never the generation, so every attempt of a step shares it and no other job has it.';

DROP TABLE __SCHEMA__.schema_identity;

CREATE FUNCTION __SCHEMA__.claim_capped(
    p_queues text[],
    p_kinds text[],
    p_limit integer,
    p_budget bigint,
    p_first_over_budget boolean,
    p_owner text,
    p_at timestamptz,
    p_lease_secs float8,
    p_history boolean,
    p_capped text[],
    p_caps integer[])
RETURNS TABLE (id bigint, queue text, kind text, job_key text, key_seq bigint,
               priority smallint, payload jsonb, payload_bytes integer, attempts integer,
               max_attempts integer, generation bigint, lease_until timestamptz,
               created_at timestamptz, claimed_at timestamptz, effect_identity text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    t timestamptz := coalesce(p_at, statement_timestamp());
    ids bigint[] := '{}';
    bytes bigint := 0;
    remaining integer := p_limit;
    -- What is left of each capped queue's cap (positions of p_capped).
    caps integer[] := p_caps;
    k integer;
    level smallint;
    -- Each queue's first pending entry at or above the current level.
    sq text[];
    sp smallint[];
    sa timestamptz[];
    si bigint[];
    r record;
BEGIN
    SELECT array_agg(u.q), array_agg(f.priority), array_agg(f.available_at), array_agg(f.id)
    INTO sq, sp, sa, si
    FROM unnest(p_queues) u(q)
    CROSS JOIN LATERAL (SELECT j.priority, j.available_at, j.id FROM __SCHEMA__.jobs j
                        WHERE j.state = 'pending' AND j.queue = u.q
                          AND j.priority >= (-32768)::int2
                        ORDER BY j.priority, j.available_at, j.id
                        LIMIT 1) f
    WHERE coalesce(caps[array_position(p_capped, u.q)], 1) > 0;
    level := (SELECT min(x) FROM unnest(sp) x);
    <<levels>>
    WHILE level IS NOT NULL AND remaining > 0 LOOP
        FOR r IN
            SELECT c.id, c.payload_bytes, s.q
            FROM unnest(sq, sp, sa, si) s(q, p, a, i)
            CROSS JOIN LATERAL (
                SELECT j.id, j.available_at, j.payload_bytes FROM __SCHEMA__.jobs j
                WHERE j.state = 'pending' AND j.queue = s.q AND j.priority = level
                  AND (j.available_at, j.id) >= (s.a, s.i)
                  AND j.available_at <= t
                  AND (p_kinds IS NULL OR j.kind = ANY (p_kinds))
                ORDER BY j.available_at, j.id
                LIMIT least(remaining, coalesce(caps[array_position(p_capped, s.q)], remaining))
                FOR UPDATE OF j SKIP LOCKED) c
            WHERE s.p = level
            ORDER BY c.available_at, c.id
            LIMIT remaining
        LOOP
            IF bytes + r.payload_bytes > p_budget
               AND NOT (p_first_over_budget AND cardinality(ids) = 0) THEN
                EXIT levels;
            END IF;
            ids := ids || r.id;
            bytes := bytes + r.payload_bytes;
            remaining := remaining - 1;
            k := array_position(p_capped, r.q);
            IF k IS NOT NULL THEN
                caps[k] := caps[k] - 1;
            END IF;
        END LOOP;
        EXIT levels WHEN remaining = 0 OR level = 32767;
        -- The queues at this level move to their first entry past it, unless their cap
        -- is spent; the others keep the position they have.
        SELECT array_agg(n.q), array_agg(n.p), array_agg(n.a), array_agg(n.i)
        INTO sq, sp, sa, si
        FROM (
            SELECT s.q, s.p, s.a, s.i FROM unnest(sq, sp, sa, si) s(q, p, a, i)
            WHERE s.p > level
            UNION ALL
            SELECT s.q, f.priority, f.available_at, f.id
            FROM unnest(sq, sp) s(q, p)
            CROSS JOIN LATERAL (SELECT j.priority, j.available_at, j.id FROM __SCHEMA__.jobs j
                                WHERE j.state = 'pending' AND j.queue = s.q
                                  AND j.priority >= (level + 1)::int2
                                ORDER BY j.priority, j.available_at, j.id
                                LIMIT 1) f
            WHERE s.p = level AND coalesce(caps[array_position(p_capped, s.q)], 1) > 0) n;
        level := (SELECT min(x) FROM unnest(sp) x);
    END LOOP;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH u AS (
        UPDATE __SCHEMA__.jobs j
        SET state = 'running', owner = p_owner, generation = j.generation + 1,
            attempts = j.attempts + 1, claimed_at = t,
            lease_until = t + make_interval(secs => p_lease_secs)
        WHERE j.id = ANY (ids)
        RETURNING j.id, j.queue, j.kind, j.job_key, j.key_seq, j.priority, j.payload,
                  j.payload_bytes, j.attempts, j.max_attempts, j.generation,
                  j.lease_until, j.created_at, j.claimed_at, j.effect_identity::text
    ), ev AS (
        INSERT INTO __SCHEMA__.job_events (job_id, generation, event, owner, at)
        SELECT u.id, u.generation, 'claimed', p_owner, u.claimed_at FROM u WHERE p_history
    )
    SELECT * FROM u ORDER BY u.priority, u.id;
END
$fn$;

COMMENT ON FUNCTION __SCHEMA__.claim_capped(text[], text[], integer, bigint, boolean, text, timestamptz, float8, boolean, text[], integer[]) IS
    'Claim up to p_limit due jobs of p_queues (and p_kinds, NULL: any) within p_budget payload bytes for p_owner, leased for p_lease_secs from p_at (NULL: now), at most p_caps[i] of queue p_capped[i] (NULL: no caps). Returns each job''s effect_identity too. See src/store/claim.rs and migrations/0021_job_effect_identity.sql.';

-- Kept for a scheduler of a build older than version 16 still running during a rolling
-- deploy: the claim without caps, with the columns it always returned.
CREATE FUNCTION __SCHEMA__.claim(
    p_queues text[],
    p_kinds text[],
    p_limit integer,
    p_budget bigint,
    p_first_over_budget boolean,
    p_owner text,
    p_at timestamptz,
    p_lease_secs float8,
    p_history boolean)
RETURNS TABLE (id bigint, queue text, kind text, job_key text, key_seq bigint,
               priority smallint, payload jsonb, payload_bytes integer, attempts integer,
               max_attempts integer, generation bigint, lease_until timestamptz,
               created_at timestamptz, claimed_at timestamptz)
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT c.id, c.queue, c.kind, c.job_key, c.key_seq, c.priority, c.payload, c.payload_bytes,
           c.attempts, c.max_attempts, c.generation, c.lease_until, c.created_at, c.claimed_at
    FROM __SCHEMA__.claim_capped(p_queues, p_kinds, p_limit, p_budget,
                                          p_first_over_budget, p_owner, p_at, p_lease_secs,
                                          p_history, NULL::text[], NULL::integer[]) c
$fn$;

COMMENT ON FUNCTION __SCHEMA__.claim(text[], text[], integer, bigint, boolean, text, timestamptz, float8, boolean) IS
    'claim_capped without caps, for schedulers of builds before migration 16. See migrations/0021_job_effect_identity.sql.';

-- Promotion and keyed completion as in version 3, each claimed successor with its
-- effect_identity. And keyed completion waits for key rows others hold for at most
-- p_wait_ms (NULL: it skips them, as p_wait false did; 0: as long as the session's
-- lock_timeout allows, as p_wait true did), in its own statement's
-- transaction: the completions that wait take turns on one connection, and a turn of
-- the session's whole lock_timeout each made the completion of a key held for a moment
-- wait behind every key held for long (six such keys: 1.3 s; twelve: past a 2 s lease).
CREATE FUNCTION __SCHEMA__.promote(
    p_queues text[],
    p_keys text[],
    p_chain boolean[],
    p_owner text,
    p_kinds text[],
    p_lease_secs float8,
    p_history boolean,
    p_channel text)
RETURNS TABLE (id bigint, queue text, kind text, job_key text, key_seq bigint,
               priority smallint, payload jsonb, payload_bytes integer, attempts integer,
               max_attempts integer, generation bigint, lease_until timestamptz,
               created_at timestamptz, claimed_at timestamptz, effect_identity text,
               taken boolean)
LANGUAGE plpgsql
SET jit = off
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH nxt AS (
        SELECT w.id, w.available_at, w.kind, t.chain
        FROM (SELECT x.q, x.k, bool_or(x.c) AS chain
                FROM unnest(p_queues, p_keys, p_chain) AS x(q, k, c)
               GROUP BY x.q, x.k) t
        CROSS JOIN LATERAL (
            SELECT j.id, j.available_at, j.kind FROM __SCHEMA__.jobs j
            WHERE j.queue = t.q AND j.job_key = t.k AND j.state = 'waiting'
            ORDER BY j.key_seq
            LIMIT 1
        ) w
    ), c AS (
        SELECT nxt.id,
               coalesce(nxt.chain AND nxt.available_at <= clock_timestamp()
                        AND nxt.kind = ANY (p_kinds), false) AS taken
        FROM nxt
    ), u AS (
        UPDATE __SCHEMA__.jobs j
        SET state = CASE WHEN c.taken THEN 'running' ELSE 'pending' END,
            available_at = greatest(j.available_at, clock_timestamp()),
            owner = CASE WHEN c.taken THEN p_owner ELSE j.owner END,
            generation = j.generation + CASE WHEN c.taken THEN 1 ELSE 0 END,
            attempts = j.attempts + CASE WHEN c.taken THEN 1 ELSE 0 END,
            claimed_at = CASE WHEN c.taken THEN clock_timestamp() ELSE j.claimed_at END,
            lease_until = CASE WHEN c.taken
                THEN clock_timestamp() + make_interval(secs => p_lease_secs) END
        FROM c WHERE j.id = c.id AND j.state = 'waiting'
        RETURNING j.id, j.queue, j.kind, j.job_key, j.key_seq, j.priority, j.payload,
                  j.payload_bytes, j.attempts, j.max_attempts, j.generation,
                  j.lease_until, j.created_at, j.claimed_at, j.effect_identity::text, c.taken
    ), ev AS (
        INSERT INTO __SCHEMA__.job_events (job_id, generation, event, owner, at)
        SELECT u.id, u.generation - u.taken::int, 'promoted', NULL, clock_timestamp()
        FROM u WHERE p_history
        UNION ALL
        SELECT u.id, u.generation, 'claimed', p_owner, u.claimed_at FROM u WHERE p_history AND u.taken
    ), announced AS (
        SELECT count(pg_notify(p_channel, left(q.queue, 1000))) AS n
        FROM (SELECT DISTINCT u.queue FROM u WHERE NOT u.taken) q
    )
    SELECT u.* FROM u, announced WHERE announced.n >= 0;
END
$fn$;

COMMENT ON FUNCTION __SCHEMA__.promote(text[], text[], boolean[], text, text[], float8, boolean, text) IS
    'Promote (and, where p_chain, claim for p_owner) the next waiting job of each (queue, key) whose head ended in this transaction. Returns each job''s effect_identity too. See src/store/keys.rs and migrations/0021_job_effect_identity.sql.';

CREATE FUNCTION __SCHEMA__.complete_keyed(
    p_ids bigint[],
    p_generations bigint[],
    p_results jsonb[],
    p_queues text[],
    p_keys text[],
    p_chain boolean[],
    p_wait_ms integer,
    p_owner text,
    p_kinds text[],
    p_lease_secs float8,
    p_history boolean,
    p_channel text)
RETURNS TABLE (row_kind text, id bigint, generation bigint, queue text, kind text,
               job_key text, key_seq bigint, priority smallint, payload jsonb,
               payload_bytes integer, attempts integer, max_attempts integer,
               lease_until timestamptz, created_at timestamptz, claimed_at timestamptz,
               claimed_after_secs float8, effect_identity text)
LANGUAGE plpgsql
SET jit = off
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    lq text[];
    lk text[];
    di bigint[];
    dg bigint[];
    dq text[];
    dk text[];
    dc boolean[];
BEGIN
    IF p_wait_ms IS NOT NULL THEN
        -- For this statement's transaction only: a turn of waiting is short, whatever
        -- the session's own bound (see the note above the function). 0: the session's.
        IF p_wait_ms > 0 THEN
            PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
        END IF;
        SELECT array_agg(l.queue), array_agg(l.job_key) INTO lq, lk FROM (
            SELECT jk.queue, jk.job_key FROM __SCHEMA__.job_keys jk
            JOIN (SELECT DISTINCT x.q, x.k FROM unnest(p_queues, p_keys) AS x(q, k)) d
              ON jk.queue = d.q AND jk.job_key = d.k
            ORDER BY jk.queue, jk.job_key
            FOR UPDATE OF jk) l;
    ELSE
        SELECT array_agg(l.queue), array_agg(l.job_key) INTO lq, lk FROM (
            SELECT jk.queue, jk.job_key FROM __SCHEMA__.job_keys jk
            JOIN (SELECT DISTINCT x.q, x.k FROM unnest(p_queues, p_keys) AS x(q, k)) d
              ON jk.queue = d.q AND jk.job_key = d.k
            ORDER BY jk.queue, jk.job_key
            FOR UPDATE OF jk SKIP LOCKED) l;
    END IF;
    RETURN QUERY
    SELECT 'busy'::text, i.id, i.g, NULL::text, NULL::text, NULL::text, NULL::bigint,
           NULL::smallint, NULL::jsonb, NULL::integer, NULL::integer, NULL::integer,
           NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::float8, NULL::text
    FROM unnest(p_ids, p_generations, p_queues, p_keys) AS i(id, g, q, k)
    WHERE NOT EXISTS (SELECT 1 FROM unnest(lq, lk) AS l(q, k) WHERE l.q = i.q AND l.k = i.k);

    WITH items AS (
        SELECT i.* FROM unnest(p_ids, p_generations, p_results, p_queues, p_keys, p_chain)
          AS i(id, g, result, q, k, chain)
        WHERE EXISTS (SELECT 1 FROM unnest(lq, lk) AS l(q, k) WHERE l.q = i.q AND l.k = i.k)
    ), u AS (
        UPDATE __SCHEMA__.jobs j
        SET state = 'done', result = items.result, finished_at = clock_timestamp(),
            lease_until = NULL
        FROM items
        WHERE j.id = items.id AND j.generation = items.g AND j.owner = p_owner
          AND j.state = 'running'
        RETURNING j.id, j.generation, j.queue, j.job_key, items.chain
    ), ev AS (
        INSERT INTO __SCHEMA__.job_events (job_id, generation, event, owner, at)
        SELECT u.id, u.generation, 'completed', p_owner, clock_timestamp() FROM u WHERE p_history
    ), k AS (
        UPDATE __SCHEMA__.job_keys jk
        SET open_jobs = jk.open_jobs - d.n
        FROM (SELECT u.queue, u.job_key, count(*) AS n FROM u GROUP BY u.queue, u.job_key) d
        WHERE jk.queue = d.queue AND jk.job_key = d.job_key
    )
    SELECT array_agg(u.id), array_agg(u.generation), array_agg(u.queue), array_agg(u.job_key),
           array_agg(u.chain)
    INTO di, dg, dq, dk, dc FROM u;

    RETURN QUERY
    SELECT 'done'::text, d.id, d.g, NULL::text, NULL::text, NULL::text, NULL::bigint,
           NULL::smallint, NULL::jsonb, NULL::integer, NULL::integer, NULL::integer,
           NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::float8, NULL::text
    FROM unnest(di, dg) AS d(id, g);

    IF cardinality(dq) > 0 THEN
        RETURN QUERY
        SELECT 'next'::text, n.id, n.generation, n.queue, n.kind, n.job_key, n.key_seq,
               n.priority, n.payload, n.payload_bytes, n.attempts, n.max_attempts,
               n.lease_until, n.created_at, n.claimed_at,
               extract(epoch FROM n.claimed_at - statement_timestamp())::float8,
               n.effect_identity
        FROM __SCHEMA__.promote(dq, dk, dc, p_owner, p_kinds, p_lease_secs, p_history,
                                p_channel) n
        WHERE n.taken;
    END IF;
END
$fn$;

COMMENT ON FUNCTION __SCHEMA__.complete_keyed(bigint[], bigint[], jsonb[], text[], text[], boolean[], integer, text, text[], float8, boolean, text) IS
    'Complete keyed jobs of p_owner in one call: lock their keys, complete, leave the keys, promote and chain-claim successors. Successors carry their effect_identity. See src/store/complete.rs and migrations/0021_job_effect_identity.sql.';
