-- leasehold schema, version 16: per-queue caps inside the one claim statement.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: a scheduler with per-queue limits (`Config::queue_concurrency`) claimed with one
-- statement per limited queue, each for that queue's whole room, and one statement for
-- the other queues with what was left of the batch. A limited queue with nothing due
-- (empty, paused, only delayed jobs) kept its room out of the round all the same: with
-- concurrency 4 and a limit of 4 on an empty queue, no job of any other queue started.
-- Priorities across queues did not hold either (the limited queues' statements ran
-- first, whatever the priorities). Now one claim takes every queue, in the usual order
-- (priority, then available_at and id merged across the queues), and a capped queue
-- stops taking at its cap: what it does not use goes to the others in the same claim.
--
-- claim_capped is the claim with two more parameters. p_capped / p_caps: queue names and,
-- at the same positions, the most jobs of that queue this claim may take. A queue of
-- p_queues not named in p_capped has no cap; both NULL: no caps, and the claim is version
-- 11's. (A new name, not an overload of claim: `DROP FUNCTION claim` and the like stay
-- unambiguous.) Each level's locking scan of a capped queue is limited by what is left of
-- its cap, so a capped queue's jobs past its cap are neither locked nor walked; a queue
-- whose cap is spent is not probed for the next level. Same settings, walk and result as
-- version 11 otherwise.
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
                  j.lease_until, j.created_at, j.claimed_at
    ), ev AS (
        INSERT INTO __SCHEMA__.job_events (job_id, generation, event, owner, at)
        SELECT u.id, u.generation, 'claimed', p_owner, u.claimed_at FROM u WHERE p_history
    )
    SELECT * FROM u ORDER BY u.priority, u.id;
END
$fn$;

COMMENT ON FUNCTION __SCHEMA__.claim_capped(text[], text[], integer, bigint, boolean, text, timestamptz, float8, boolean, text[], integer[]) IS
    'Claim up to p_limit due jobs of p_queues (and p_kinds, NULL: any) within p_budget payload bytes for p_owner, leased for p_lease_secs from p_at (NULL: now), at most p_caps[i] of queue p_capped[i] (NULL: no caps). See src/store/claim.rs and migrations/0016_claim_caps.sql.';

-- The claim of versions 3 and 11 is now claim_capped without caps, so there is one walk to
-- keep right. Kept for a scheduler of an older build still running against this schema
-- during a rolling deploy.
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
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT * FROM __SCHEMA__.claim_capped(p_queues, p_kinds, p_limit, p_budget,
                                          p_first_over_budget, p_owner, p_at, p_lease_secs,
                                          p_history, NULL::text[], NULL::integer[])
$fn$;

COMMENT ON FUNCTION __SCHEMA__.claim(text[], text[], integer, bigint, boolean, text, timestamptz, float8, boolean) IS
    'claim_capped without caps, for schedulers of builds before migration 16. See migrations/0016_claim_caps.sql.';
