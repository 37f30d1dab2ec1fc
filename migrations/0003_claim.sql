-- leasehold schema, version 3: a claim whose plan does not depend on planner statistics,
-- and that stops at the queue and at the first delayed job.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Claim: pending rows per queue, in claim order within each priority. With the queue and
-- the priority fixed, `available_at <= now` bounds the scan: delayed jobs and other
-- queues' jobs are never walked.
CREATE INDEX jobs_claimable_by_queue ON __SCHEMA__.jobs (queue, priority, available_at, id)
    WHERE state = 'pending';
DROP INDEX __SCHEMA__.jobs_claimable;

-- The claim, as one function call (one round trip). It takes the priorities present in
-- the scheduler's queues in ascending order (one index probe each); for each, it locks
-- the due jobs of every queue in (available_at, id) order with SKIP LOCKED, merged across
-- the queues, until the limit or the byte budget is reached; then it leases what it
-- took. Its plans are generic and may only use index scans (the SET clauses below apply
-- inside the function only): on a table that was never analyzed, the planner's row
-- estimates are guesses, and with sorts and sequential scans allowed it chose to read and
-- sort every pending row on each claim. JIT is off: the cost penalty that rules a sort
-- out would otherwise make the planner JIT-compile a sub-millisecond query (~260 ms).
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
    r record;
BEGIN
    SELECT min(x.p) INTO level
    FROM unnest(p_queues) u(q)
    CROSS JOIN LATERAL (SELECT min(j.priority) AS p FROM __SCHEMA__.jobs j
                        WHERE j.state = 'pending' AND j.queue = u.q) x;
    <<levels>>
    WHILE level IS NOT NULL AND remaining > 0 LOOP
        FOR r IN
            SELECT c.id, c.payload_bytes
            FROM unnest(p_queues) u(q)
            CROSS JOIN LATERAL (
                SELECT j.id, j.available_at, j.payload_bytes FROM __SCHEMA__.jobs j
                WHERE j.state = 'pending' AND j.queue = u.q AND j.priority = level
                  AND j.available_at <= t
                  AND (p_kinds IS NULL OR j.kind = ANY (p_kinds))
                ORDER BY j.available_at, j.id
                LIMIT remaining
                FOR UPDATE OF j SKIP LOCKED) c
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
        SELECT min(x.p) INTO level
        FROM unnest(p_queues) u(q)
        CROSS JOIN LATERAL (SELECT min(j.priority) AS p FROM __SCHEMA__.jobs j
                            WHERE j.state = 'pending' AND j.queue = u.q
                              AND j.priority > level) x;
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
    'Claim up to p_limit due jobs of p_queues (and p_kinds, NULL: any) within p_budget payload bytes for p_owner, leased for p_lease_secs from p_at (NULL: now). See src/store/claim.rs.';
