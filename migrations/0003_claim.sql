-- leasehold schema, version 3: a claim whose plan does not depend on planner statistics,
-- and that stops at the queue and at the first delayed job; keyed completion and
-- promotion as functions (one round trip each).
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

-- Promote each key's next waiting job, after its head ended (the caller left the key in
-- this transaction, holding its row lock). Where p_chain is set, the successor is also
-- claimed for p_owner (when due and of a kind it runs), leased from clock_timestamp():
-- the key's next job then needs no claim of its own. Successors that are only promoted
-- are announced (NOTIFY p_channel). Its own statement, so it reads a snapshot taken after
-- the key lock was granted: it sees a successor whose enqueue committed meanwhile.
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
               created_at timestamptz, claimed_at timestamptz, taken boolean)
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
                  j.lease_until, j.created_at, j.claimed_at, c.taken
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
    'Promote (and, where p_chain, claim for p_owner) the next waiting job of each (queue, key) whose head ended in this transaction. See src/store/keys.rs.';

-- Complete keyed jobs in one call (one round trip instead of five): lock their key rows
-- in (queue, key) order — skipping rows another transaction holds unless p_wait —, complete
-- the jobs of the locked keys (fenced), leave the keys, and promote (and chain-claim) each
-- key's successor. Rows: ('busy', id, generation) for an item whose key row was busy
-- (nothing written); ('done', id, generation) for each completion; ('next', ...) for each
-- successor claimed for p_owner, with how long after the call began (database clock) its
-- lease started: the caller's local lease deadline counts from its send time plus that,
-- however long the call waited for a key row. An item in none of these was not
-- completed: its fence is gone, or an earlier completion of it committed (the caller
-- reads the row back).
CREATE FUNCTION __SCHEMA__.complete_keyed(
    p_ids bigint[],
    p_generations bigint[],
    p_results jsonb[],
    p_queues text[],
    p_keys text[],
    p_chain boolean[],
    p_wait boolean,
    p_owner text,
    p_kinds text[],
    p_lease_secs float8,
    p_history boolean,
    p_channel text)
RETURNS TABLE (row_kind text, id bigint, generation bigint, queue text, kind text,
               job_key text, key_seq bigint, priority smallint, payload jsonb,
               payload_bytes integer, attempts integer, max_attempts integer,
               lease_until timestamptz, created_at timestamptz, claimed_at timestamptz,
               claimed_after_secs float8)
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
    IF p_wait THEN
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
           NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::float8
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
           NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::float8
    FROM unnest(di, dg) AS d(id, g);

    IF cardinality(dq) > 0 THEN
        RETURN QUERY
        SELECT 'next'::text, n.id, n.generation, n.queue, n.kind, n.job_key, n.key_seq,
               n.priority, n.payload, n.payload_bytes, n.attempts, n.max_attempts,
               n.lease_until, n.created_at, n.claimed_at,
               extract(epoch FROM n.claimed_at - statement_timestamp())::float8
        FROM __SCHEMA__.promote(dq, dk, dc, p_owner, p_kinds, p_lease_secs, p_history,
                                p_channel) n
        WHERE n.taken;
    END IF;
END
$fn$;

COMMENT ON FUNCTION __SCHEMA__.complete_keyed(bigint[], bigint[], jsonb[], text[], text[], boolean[], boolean, text, text[], float8, boolean, text) IS
    'Complete keyed jobs of p_owner in one call: lock their keys, complete, leave the keys, promote and chain-claim successors. See src/store/complete.rs.';
