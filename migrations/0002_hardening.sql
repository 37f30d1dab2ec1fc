-- leasehold schema, version 2: cancel requests for running jobs, and key-sequence
-- floors so retention can delete idle key rows without key_seq ever going backwards.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

ALTER TABLE __SCHEMA__.jobs ADD COLUMN cancel_requested_at timestamptz;
COMMENT ON COLUMN __SCHEMA__.jobs.cancel_requested_at IS 'Set when an operator cancels a running job: the owner is told at once and the job stays running until that attempt ends (completion: done; failure, release or expired lease: cancelled). The key moves on only then.';

-- The time columns, restated with the clock each one uses (version 1 said "database time").
COMMENT ON COLUMN __SCHEMA__.jobs.created_at IS 'clock_timestamp() when the INSERT ran. A job enqueued inside a longer transaction becomes visible at its commit, later than this.';
COMMENT ON COLUMN __SCHEMA__.jobs.available_at IS 'Database time from which a pending job may be claimed: run-at, or clock_timestamp() at the INSERT plus the delay, or the retry backoff.';
COMMENT ON COLUMN __SCHEMA__.jobs.claimed_at IS 'Time of the latest claim: the claim statement''s start (statement_timestamp()), or clock_timestamp() when a completion claims its key''s successor inside a longer transaction.';
COMMENT ON COLUMN __SCHEMA__.jobs.lease_until IS 'While running: the database time after which the reaper may take the job back; claimed_at + lease at the claim, clock_timestamp() + lease at each renewal. NULL otherwise.';

CREATE TABLE __SCHEMA__.key_floors (
    slot   integer PRIMARY KEY,
    floor  bigint  NOT NULL DEFAULT 0,
    CONSTRAINT key_floors_slot_range CHECK (slot >= 0 AND slot < 64)
);
INSERT INTO __SCHEMA__.key_floors (slot) SELECT generate_series(0, 63);
COMMENT ON TABLE  __SCHEMA__.key_floors IS 'Where a re-created key row starts its key_seq: retention deletes a key row only when no job of the key is left, and raises its slot''s floor to that row''s next_seq first, so key_seq (and the per-key fencing token built on it) never goes backwards for a key. 64 slots by hash of (queue, key), so enqueues of different keys rarely share one.';
COMMENT ON COLUMN __SCHEMA__.key_floors.slot IS 'hashtext(queue || ''/'' || job_key) & 63 (a collision only means two keys share a floor); see src/store/keys.rs.';
COMMENT ON COLUMN __SCHEMA__.key_floors.floor IS 'At least the next_seq of every key row of this slot that retention deleted. A new key row starts at floor + 1.';

-- Repair what version 1's retention did: it deleted key rows with no open job while jobs
-- of the key remained, so a key could come back at key_seq 1, below its own jobs, and a
-- dead job of the Continue policy could not be retried. Every key with a job gets its
-- row back, never below its jobs' key_seq.
INSERT INTO __SCHEMA__.job_keys (queue, job_key, next_seq, open_jobs)
SELECT queue, job_key, max(key_seq), 0
FROM __SCHEMA__.jobs WHERE job_key IS NOT NULL
GROUP BY queue, job_key
ON CONFLICT (queue, job_key) DO UPDATE
    SET next_seq = greatest(__SCHEMA__.job_keys.next_seq, excluded.next_seq);
