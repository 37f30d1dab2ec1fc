-- leasehold schema, version 4: held and dead jobs by queue, so the metrics' per-queue
-- gauges count them without walking the terminal history.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Metrics: jobs parked until an operator acts (held) or that gave up (dead), per queue.
-- Small by design (retention prunes dead rows), and read by `Store::queue_gauges` with
-- the same predicate, so the planner may use it.
CREATE INDEX jobs_parked_by_queue ON __SCHEMA__.jobs (queue, state)
    WHERE state IN ('held', 'dead');
