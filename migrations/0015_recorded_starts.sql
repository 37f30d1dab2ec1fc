-- leasehold schema, version 15: an expired lease counts as an attempt only when the
-- attempt's handler was recorded as started.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: a claim counts its attempt (attempts + 1), so a handler that kills its process
-- still reaches dead within its attempts. But a scheduler claims ahead of its free slots
-- (`Config::claim_ahead`), and a job waiting in a process for a slot has not started:
-- when that process died, the reaper counted the claim as an attempt, and with
-- max_attempts = 1 one crash made every job it had waiting dead without running any.
-- The owner records the start of each attempt with the lease renewals it writes anyway
-- (within a fraction of a second of the start: see src/actor/lease_renewer.rs), and the
-- reaper gives back the attempt of an expired lease whose start was never recorded. A
-- handler that kills its process before its start is recorded would then never be
-- counted, so such give-backs are bounded per job (`unstarted_expiries`): past the bound,
-- expiries count again whatever was recorded. During a rolling deploy, processes of the
-- previous version record no starts: their expired leases are given back uncounted, within
-- that bound, and their own reapers count every expiry as before.
ALTER TABLE __SCHEMA__.jobs
    ADD COLUMN started_generation bigint,
    ADD COLUMN unstarted_expiries integer NOT NULL DEFAULT 0;

COMMENT ON COLUMN __SCHEMA__.jobs.started_generation IS
    'The latest generation whose handler its owner recorded as started (written with its lease renewals). An expired lease of another generation was claimed but never started.';
COMMENT ON COLUMN __SCHEMA__.jobs.unstarted_expiries IS
    'Expired leases whose start was never recorded, given back without counting an attempt; bounded (see the reaper), so a handler that kills its process before its start is recorded still reaches dead.';
