-- leasehold schema, version 5: lease expiries by time, so `Store::queue_stats` counts the
-- recent ones (the figure an alert watches) without reading the whole record.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Statistics: lease expiries of the last minutes, per queue through the job's primary key.
CREATE INDEX lease_expiries_by_time ON __SCHEMA__.lease_expiries (reaped_at);
