-- leasehold schema, version 23: a batch of keyed completions waits for a job row another
-- session holds only a short, bounded while, and can skip it, as it skips a held key row.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: the batch's UPDATE waited for every job row of the batch. A session holding one
-- running job's row (a report's `SELECT … FOR UPDATE`, a migration) held up the endings of
-- all the jobs written with it, and each retry of the held job's own ending held up the
-- next batch: the fault harness saw a finished job's ending land 2.5 s after its handler
-- returned, past its lease, while a session held two other rows of its worker (seed
-- 20261207). A new last parameter, p_row_wait_ms, bounds the wait for job rows (NULL:
-- skip them; 0: the session's lock_timeout; more: at most that long). A batch waits a
-- short turn first, since a claim's scan holds for a moment the rows it passes over
-- (always skipping them cost 90% of the throughput), and skips them when the turn runs
-- out: a held row is reported busy like a held key, and the caller writes it again alone,
-- waiting a bounded turn (src/actor/completer.rs). The function of version 21 stays, for
-- a scheduler of the previous build during a rolling deploy.
--
-- Each item also carries its job's effect_identity (p_identities), matched with the id,
-- owner and generation: a schema dropped and created again restarts ids at 1, and the
-- same process then claims the new job 1 with the same owner and generation as an
-- attempt of the dropped schema's job 1 that is still running (src/job.rs, Fence).

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
    p_channel text,
    p_row_wait_ms integer,
    p_identities uuid[])
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
    de uuid[];
    dq text[];
    dk text[];
    dc boolean[];
    li bigint[];
    saved text;
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
    -- The job rows next, as p_row_wait_ms says; the session's lock_timeout is put back
    -- for the promotion after a bounded wait.
    IF p_row_wait_ms IS NULL THEN
        SELECT array_agg(l.id) INTO li FROM (
            SELECT j.id FROM __SCHEMA__.jobs j
            JOIN unnest(p_ids, p_generations, p_queues, p_keys, p_identities) AS i(id, g, q, k, e)
              ON j.id = i.id AND j.generation = i.g AND j.effect_identity = i.e
            WHERE j.owner = p_owner AND j.state = 'running'
              AND EXISTS (SELECT 1 FROM unnest(lq, lk) AS l(q, k) WHERE l.q = i.q AND l.k = i.k)
            ORDER BY j.id
            FOR UPDATE OF j SKIP LOCKED) l;
    ELSE
        saved := current_setting('lock_timeout');
        IF p_row_wait_ms > 0 THEN
            PERFORM set_config('lock_timeout', p_row_wait_ms || 'ms', true);
        END IF;
        SELECT array_agg(l.id) INTO li FROM (
            SELECT j.id FROM __SCHEMA__.jobs j
            JOIN unnest(p_ids, p_generations, p_queues, p_keys, p_identities) AS i(id, g, q, k, e)
              ON j.id = i.id AND j.generation = i.g AND j.effect_identity = i.e
            WHERE j.owner = p_owner AND j.state = 'running'
              AND EXISTS (SELECT 1 FROM unnest(lq, lk) AS l(q, k) WHERE l.q = i.q AND l.k = i.k)
            ORDER BY j.id
            FOR UPDATE OF j) l;
        PERFORM set_config('lock_timeout', saved, true);
    END IF;

    -- Busy: an item whose key row is held, or (skipping) whose job row is held while it
    -- is still this owner's running attempt. Nothing is written for it. Every other item
    -- whose row is this owner's running attempt is locked (li) and completed.
    RETURN QUERY
    SELECT 'busy'::text, i.id, i.g, NULL::text, NULL::text, NULL::text, NULL::bigint,
           NULL::smallint, NULL::jsonb, NULL::integer, NULL::integer, NULL::integer,
           NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::float8, i.e::text
    FROM unnest(p_ids, p_generations, p_queues, p_keys, p_identities) AS i(id, g, q, k, e)
    WHERE (NOT EXISTS (SELECT 1 FROM unnest(lq, lk) AS l(q, k) WHERE l.q = i.q AND l.k = i.k)
           -- A key row that does not exist is not held: its job is gone (stale).
           AND EXISTS (SELECT 1 FROM __SCHEMA__.job_keys jk WHERE jk.queue = i.q AND jk.job_key = i.k))
       OR (p_row_wait_ms IS NULL AND i.id <> ALL (coalesce(li, '{}'))
           AND EXISTS (SELECT 1 FROM __SCHEMA__.jobs j
                       WHERE j.id = i.id AND j.generation = i.g AND j.owner = p_owner
                         AND j.effect_identity = i.e AND j.state = 'running'));

    WITH items AS (
        SELECT i.* FROM unnest(p_ids, p_generations, p_results, p_queues, p_keys, p_chain,
                               p_identities)
          AS i(id, g, result, q, k, chain, e)
        WHERE EXISTS (SELECT 1 FROM unnest(lq, lk) AS l(q, k) WHERE l.q = i.q AND l.k = i.k)
          AND i.id = ANY (li)
    ), u AS (
        UPDATE __SCHEMA__.jobs j
        SET state = 'done', result = items.result, finished_at = clock_timestamp(),
            lease_until = NULL
        FROM items
        WHERE j.id = items.id AND j.generation = items.g AND j.owner = p_owner
          AND j.effect_identity = items.e AND j.state = 'running'
        RETURNING j.id, j.generation, j.effect_identity, j.queue, j.job_key, items.chain
    ), ev AS (
        INSERT INTO __SCHEMA__.job_events (job_id, generation, event, owner, at)
        SELECT u.id, u.generation, 'completed', p_owner, clock_timestamp() FROM u WHERE p_history
    ), k AS (
        UPDATE __SCHEMA__.job_keys jk
        SET open_jobs = jk.open_jobs - d.n
        FROM (SELECT u.queue, u.job_key, count(*) AS n FROM u GROUP BY u.queue, u.job_key) d
        WHERE jk.queue = d.queue AND jk.job_key = d.job_key
    )
    SELECT array_agg(u.id), array_agg(u.generation), array_agg(u.effect_identity),
           array_agg(u.queue), array_agg(u.job_key), array_agg(u.chain)
    INTO di, dg, de, dq, dk, dc FROM u;

    RETURN QUERY
    SELECT 'done'::text, d.id, d.g, NULL::text, NULL::text, NULL::text, NULL::bigint,
           NULL::smallint, NULL::jsonb, NULL::integer, NULL::integer, NULL::integer,
           NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::float8, d.e::text
    FROM unnest(di, dg, de) AS d(id, g, e);

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

COMMENT ON FUNCTION __SCHEMA__.complete_keyed(bigint[], bigint[], jsonb[], text[], text[], boolean[], integer, text, text[], float8, boolean, text, integer, uuid[]) IS
    'Complete keyed jobs of p_owner in one call: lock their keys (skipped when held, unless p_wait_ms is set), then their rows (skipped when held if p_row_wait_ms is NULL, else waited for at most that long), complete (each row matched by id, owner, generation and p_identities: ids repeat in a schema created again), leave the keys, promote and chain-claim successors. Busy and done rows carry the item''s effect_identity, successors theirs. See src/store/complete.rs and migrations/0023_completions_skip_held_rows.sql.';
