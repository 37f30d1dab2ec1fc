-- leasehold schema, version 11: the claim walks the claimed entries ahead of a queue's
-- first pending job once, not twice.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: every claim leaves the index entries of the rows it took behind it (their
-- pending versions are dead), and until VACUUM removes them every later scan from the
-- head of a queue steps over them. Version 3's claim stepped over them twice per claim:
-- once in the probe for the lowest priority present (min(priority)), once in that
-- level's locking scan. Mid-way through draining 100,000 jobs that was about 300 index
-- pages each, most of a claim's cost. Now the probe returns the position of each queue's
-- first pending entry (priority, available_at, id), and the level's locking scan starts
-- there. Nothing is skipped that the old claim would have taken: no pending row sorts
-- before that entry when the probe reads it (a row committed between the probe and the
-- scan may be left for the next claim, as one committed just after the claim is). Queues
-- whose first entry lies at a higher priority keep their position for their level, so
-- no entry is walked twice across levels either. Same signature, settings and result.
CREATE OR REPLACE FUNCTION __SCHEMA__.claim(
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
                        LIMIT 1) f;
    level := (SELECT min(x) FROM unnest(sp) x);
    <<levels>>
    WHILE level IS NOT NULL AND remaining > 0 LOOP
        FOR r IN
            SELECT c.id, c.payload_bytes
            FROM unnest(sq, sp, sa, si) s(q, p, a, i)
            CROSS JOIN LATERAL (
                SELECT j.id, j.available_at, j.payload_bytes FROM __SCHEMA__.jobs j
                WHERE j.state = 'pending' AND j.queue = s.q AND j.priority = level
                  AND (j.available_at, j.id) >= (s.a, s.i)
                  AND j.available_at <= t
                  AND (p_kinds IS NULL OR j.kind = ANY (p_kinds))
                ORDER BY j.available_at, j.id
                LIMIT remaining
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
        END LOOP;
        EXIT levels WHEN remaining = 0 OR level = 32767;
        -- The queues at this level move to their first entry past it; the others keep
        -- the position they have.
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
            WHERE s.p = level) n;
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
                  j.lease_until, j.created_at, j.claimed_at
    ), ev AS (
        INSERT INTO __SCHEMA__.job_events (job_id, generation, event, owner, at)
        SELECT u.id, u.generation, 'claimed', p_owner, u.claimed_at FROM u WHERE p_history
    )
    SELECT * FROM u ORDER BY u.priority, u.id;
END
$fn$;

COMMENT ON FUNCTION __SCHEMA__.claim(text[], text[], integer, bigint, boolean, text, timestamptz, float8, boolean) IS
    'Claim up to p_limit due jobs of p_queues (and p_kinds, NULL: any) within p_budget payload bytes for p_owner, leased for p_lease_secs from p_at (NULL: now). Each level''s scan starts at the position its probe found (migration 11). See src/store/claim.rs.';
