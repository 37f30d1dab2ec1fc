-- leasehold schema, version 1.
-- `__SCHEMA__` is replaced by the validated, quoted schema name (see src/store/schema.rs);
-- nothing else in this file is generated.

CREATE TABLE __SCHEMA__.jobs (
    id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue                text        NOT NULL,
    kind                 text        NOT NULL,
    job_key              text,
    key_seq              bigint,
    priority             smallint    NOT NULL DEFAULT 0,
    state                text        NOT NULL,
    payload              jsonb       NOT NULL,
    payload_bytes        integer     NOT NULL,
    result               jsonb,
    attempts             integer     NOT NULL DEFAULT 0,
    max_attempts         integer     NOT NULL,
    generation           bigint      NOT NULL DEFAULT 0,
    owner                text,
    lease_until          timestamptz,
    available_at         timestamptz NOT NULL DEFAULT now(),
    created_at           timestamptz NOT NULL DEFAULT now(),
    claimed_at           timestamptz,
    finished_at          timestamptz,
    last_error           text,
    dead_blocks_key      boolean     NOT NULL DEFAULT true,
    CONSTRAINT jobs_state_known CHECK (state IN
        ('pending', 'waiting', 'running', 'done', 'dead', 'held', 'cancelled')),
    CONSTRAINT jobs_key_has_seq CHECK ((job_key IS NULL) = (key_seq IS NULL)),
    CONSTRAINT jobs_running_is_leased CHECK
        (state <> 'running' OR (owner IS NOT NULL AND lease_until IS NOT NULL)),
    CONSTRAINT jobs_attempts_positive CHECK (max_attempts >= 1 AND attempts >= 0)
);

COMMENT ON TABLE  __SCHEMA__.jobs IS 'One row per job. Rows are never deleted implicitly; terminal rows are pruned by the retention policy only.';
COMMENT ON COLUMN __SCHEMA__.jobs.id IS 'Job id, assigned at enqueue. Also the stable part of every effect key.';
COMMENT ON COLUMN __SCHEMA__.jobs.queue IS 'Queue name; a scheduler serves a configured set of queues. Always a bound parameter.';
COMMENT ON COLUMN __SCHEMA__.jobs.kind IS 'Handler name; only schedulers that registered this kind claim the job.';
COMMENT ON COLUMN __SCHEMA__.jobs.job_key IS 'Optional ordering key (e.g. an account): jobs of one (queue, key) run one at a time in key_seq order.';
COMMENT ON COLUMN __SCHEMA__.jobs.key_seq IS 'Position of the job within its key, taken under the key row lock at enqueue, so it follows commit order.';
COMMENT ON COLUMN __SCHEMA__.jobs.priority IS 'Lower runs first. Claim order is (priority, available_at, id).';
COMMENT ON COLUMN __SCHEMA__.jobs.state IS 'pending, waiting (keyed, behind its predecessor), running, done, dead, held, cancelled. See src/job.rs for who moves a job out of each state.';
COMMENT ON COLUMN __SCHEMA__.jobs.payload IS 'The job''s arguments as JSON, decoded by the handler into its typed payload.';
COMMENT ON COLUMN __SCHEMA__.jobs.payload_bytes IS 'Size of the payload as sent by the client, in bytes; bounds the in-flight byte budget of a claimer.';
COMMENT ON COLUMN __SCHEMA__.jobs.result IS 'Result stored by the completing attempt; returned again if the completion reply was lost.';
COMMENT ON COLUMN __SCHEMA__.jobs.attempts IS 'Attempts started (incremented at claim, so a crash loop still counts).';
COMMENT ON COLUMN __SCHEMA__.jobs.max_attempts IS 'After this many attempts a failure or an expired lease makes the job dead.';
COMMENT ON COLUMN __SCHEMA__.jobs.generation IS 'Fencing token: +1 on every claim, never decreases. Every write by a worker is conditional on it.';
COMMENT ON COLUMN __SCHEMA__.jobs.owner IS 'Owner id (host:pid:random) of the process that claimed the current generation; kept after the job ends, for history.';
COMMENT ON COLUMN __SCHEMA__.jobs.lease_until IS 'While running: the database time after which the reaper may take the job back. NULL otherwise.';
COMMENT ON COLUMN __SCHEMA__.jobs.available_at IS 'Database time from which a pending job may be claimed (run-at, delay, retry backoff).';
COMMENT ON COLUMN __SCHEMA__.jobs.created_at IS 'Database time of the enqueue.';
COMMENT ON COLUMN __SCHEMA__.jobs.claimed_at IS 'Database time of the latest claim.';
COMMENT ON COLUMN __SCHEMA__.jobs.finished_at IS 'Database time the job reached a terminal state (done, dead, cancelled).';
COMMENT ON COLUMN __SCHEMA__.jobs.last_error IS 'Reason of the latest failed attempt, expiry, release or admin action.';
COMMENT ON COLUMN __SCHEMA__.jobs.dead_blocks_key IS 'Key policy: when true (the default) a dead job keeps its key blocked until an operator retries or cancels it.';

-- Claim: only eligible rows are in this index, so waiting backlogs and terminal history
-- never make the claim scan. The state is a literal, not a parameter, so the planner can use it.
CREATE INDEX jobs_claimable ON __SCHEMA__.jobs (priority, available_at, id) WHERE state = 'pending';
-- Promotion: the next waiting job of a key, by key_seq.
CREATE INDEX jobs_waiting_by_key ON __SCHEMA__.jobs (queue, job_key, key_seq) WHERE state = 'waiting';
-- Reaper: running rows by lease deadline.
CREATE INDEX jobs_running_by_lease ON __SCHEMA__.jobs (lease_until) WHERE state = 'running';
-- Admin and metrics: the open head of each key, and retention pruning of terminal rows.
CREATE INDEX jobs_open_by_key ON __SCHEMA__.jobs (queue, job_key)
    WHERE job_key IS NOT NULL AND state IN ('pending', 'running', 'held', 'dead');
CREATE INDEX jobs_finished ON __SCHEMA__.jobs (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE __SCHEMA__.job_keys (
    queue      text   NOT NULL,
    job_key    text   NOT NULL,
    next_seq   bigint NOT NULL,
    open_jobs  bigint NOT NULL,
    PRIMARY KEY (queue, job_key),
    CONSTRAINT job_keys_open_nonnegative CHECK (open_jobs >= 0)
);
COMMENT ON TABLE  __SCHEMA__.job_keys IS 'Per-key sequencing. Its row lock orders concurrent enqueues of one key and the promotion of successors.';
COMMENT ON COLUMN __SCHEMA__.job_keys.queue IS 'Queue of the key.';
COMMENT ON COLUMN __SCHEMA__.job_keys.job_key IS 'The ordering key.';
COMMENT ON COLUMN __SCHEMA__.job_keys.next_seq IS 'The key_seq given to the latest job enqueued under this key.';
COMMENT ON COLUMN __SCHEMA__.job_keys.open_jobs IS 'Jobs of this key not yet done or cancelled (dead jobs count while they block the key). Zero means the next enqueue is the head.';

CREATE TABLE __SCHEMA__.lease_expiries (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id       bigint      NOT NULL,
    generation   bigint      NOT NULL,
    owner        text        NOT NULL,
    lease_until  timestamptz NOT NULL,
    reaped_at    timestamptz NOT NULL,
    reaped_by    text        NOT NULL,
    new_state    text        NOT NULL,
    UNIQUE (job_id, generation)
);
COMMENT ON TABLE  __SCHEMA__.lease_expiries IS 'The reaper''s record: one row per expired lease taken back. UNIQUE(job_id, generation) makes concurrent reapers harmless.';
COMMENT ON COLUMN __SCHEMA__.lease_expiries.id IS 'Record id, in reap order.';
COMMENT ON COLUMN __SCHEMA__.lease_expiries.job_id IS 'The job whose lease expired.';
COMMENT ON COLUMN __SCHEMA__.lease_expiries.generation IS 'The generation that lost its lease; its later writes are refused.';
COMMENT ON COLUMN __SCHEMA__.lease_expiries.owner IS 'The owner that held the expired lease.';
COMMENT ON COLUMN __SCHEMA__.lease_expiries.lease_until IS 'The deadline that passed.';
COMMENT ON COLUMN __SCHEMA__.lease_expiries.reaped_at IS 'Database time of the reap (the clock that judged the lease).';
COMMENT ON COLUMN __SCHEMA__.lease_expiries.reaped_by IS 'Owner id of the reaping process.';
COMMENT ON COLUMN __SCHEMA__.lease_expiries.new_state IS 'pending (retried with backoff) or dead (attempts exhausted).';

CREATE TABLE __SCHEMA__.job_events (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id      bigint      NOT NULL,
    generation  bigint      NOT NULL,
    event       text        NOT NULL,
    owner       text,
    at          timestamptz NOT NULL DEFAULT now(),
    detail      text
);
CREATE INDEX job_events_by_job ON __SCHEMA__.job_events (job_id, id);
COMMENT ON TABLE  __SCHEMA__.job_events IS 'History of each job: every transition, written in the same transaction as the transition.';
COMMENT ON COLUMN __SCHEMA__.job_events.id IS 'Event id; per job it follows commit order because the job row lock serializes transitions.';
COMMENT ON COLUMN __SCHEMA__.job_events.job_id IS 'The job.';
COMMENT ON COLUMN __SCHEMA__.job_events.generation IS 'The job''s generation when the event happened.';
COMMENT ON COLUMN __SCHEMA__.job_events.event IS 'enqueued, claimed, completed, failed, retried, dead, reaped, released, held, unheld, cancelled, promoted, retried_by_operator.';
COMMENT ON COLUMN __SCHEMA__.job_events.owner IS 'The worker (or reaper, or operator) that made the transition.';
COMMENT ON COLUMN __SCHEMA__.job_events.at IS 'Database time of the transition.';
COMMENT ON COLUMN __SCHEMA__.job_events.detail IS 'Reason or error text, when there is one.';

CREATE TABLE __SCHEMA__.effects (
    effect_key   text        PRIMARY KEY,
    job_id       bigint      NOT NULL,
    generation   bigint      NOT NULL,
    fingerprint  text        NOT NULL,
    outcome      jsonb       NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    keep_until   timestamptz NOT NULL
);
CREATE INDEX effects_by_job ON __SCHEMA__.effects (job_id);
CREATE INDEX effects_expiry ON __SCHEMA__.effects (keep_until);
COMMENT ON TABLE  __SCHEMA__.effects IS 'Effect ledger: the outcome of each external effect, by its stable effect key, written only by the current generation.';
COMMENT ON COLUMN __SCHEMA__.effects.effect_key IS 'Stable key: job id and step name, never the generation, so every attempt of a step shares it.';
COMMENT ON COLUMN __SCHEMA__.effects.job_id IS 'The job that performed the effect.';
COMMENT ON COLUMN __SCHEMA__.effects.generation IS 'The generation (fencing token) that recorded the outcome.';
COMMENT ON COLUMN __SCHEMA__.effects.fingerprint IS 'SHA-256 of the request; the same key with another request is refused, not replayed.';
COMMENT ON COLUMN __SCHEMA__.effects.outcome IS 'The recorded outcome, returned to any later attempt instead of acting again.';
COMMENT ON COLUMN __SCHEMA__.effects.recorded_at IS 'Database time the outcome was recorded.';
COMMENT ON COLUMN __SCHEMA__.effects.keep_until IS 'The ledger keeps the row at least until then (configured to exceed the longest retry window).';
