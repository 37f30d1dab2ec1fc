-- leasehold schema, version 17: a result, progress or effect outcome nested deeper than
-- leasehold reads back is refused, whoever writes it.
-- `__SCHEMA__` is replaced by the validated, quoted schema name.

-- Why: jsonb stores any depth of nesting, but serde_json, which every reader of
-- leasehold uses (the claim, Store::job, the listings, the dashboard, the CLI, the effect
-- ledger), reads at most 127 levels of arrays and objects. The Rust write paths refuse
-- deeper values before writing (MAX_PAYLOAD_DEPTH, src/store/input.rs). These triggers
-- refuse them on the writes that do not come through those checks: the schema's own
-- complete_keyed function, called with results, and a host's own UPDATE or INSERT. A
-- NUL needs no trigger: jsonb refuses `\u0000` itself.
--
-- Not the payload: leasehold offers no enqueue in SQL, and a payload written around the
-- enqueue checks (by an older version, or by another writer) is already read per job:
-- the claim hands it over with `payload_error` and the job alone is dead with the
-- reason, and Store::job shows it (see src/store/claim.rs). A result, progress or an
-- effect outcome has no such place: a retry must read its ledger entry to not act
-- twice, and a lost completion reply is answered from the stored result.
--
-- `strict $.**{127}` is every item exactly 127 levels below the top (the top is level
-- 0); one of them being an array or an object means 128 levels or more. The level bound
-- stops the walk there, so a value 10,000 levels deep costs no more than one 128 deep.
-- Each trigger fires only on inserts and on updates that set its column, so a claim or
-- a renewal never reads these values again.

CREATE FUNCTION __SCHEMA__.refuse_unreadable_json() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RAISE EXCEPTION 'leasehold: %.% is nested deeper than 127 levels of arrays and objects, the most leasehold can read back; nothing was written',
        TG_TABLE_NAME, TG_ARGV[0]
        USING ERRCODE = 'program_limit_exceeded',
              HINT = 'Flatten the value, or store it elsewhere and keep a reference to it.';
END
$fn$;

COMMENT ON FUNCTION __SCHEMA__.refuse_unreadable_json() IS
    'Trigger function: refuses a JSON value nested deeper than 127 levels (the column named by the trigger''s argument), which leasehold''s readers (serde_json) could not read back. See migrations/0017_readable_json.sql.';

CREATE TRIGGER jobs_result_readable
    BEFORE INSERT OR UPDATE OF result ON __SCHEMA__.jobs
    FOR EACH ROW
    WHEN (pg_catalog.jsonb_path_exists(NEW.result,
          'strict $.**{127} ? (@.type() == "array" || @.type() == "object")'))
    EXECUTE FUNCTION __SCHEMA__.refuse_unreadable_json('result');

CREATE TRIGGER jobs_progress_readable
    BEFORE INSERT OR UPDATE OF progress ON __SCHEMA__.jobs
    FOR EACH ROW
    WHEN (pg_catalog.jsonb_path_exists(NEW.progress,
          'strict $.**{127} ? (@.type() == "array" || @.type() == "object")'))
    EXECUTE FUNCTION __SCHEMA__.refuse_unreadable_json('progress');

CREATE TRIGGER effects_outcome_readable
    BEFORE INSERT OR UPDATE OF outcome ON __SCHEMA__.effects
    FOR EACH ROW
    WHEN (pg_catalog.jsonb_path_exists(NEW.outcome,
          'strict $.**{127} ? (@.type() == "array" || @.type() == "object")'))
    EXECUTE FUNCTION __SCHEMA__.refuse_unreadable_json('outcome');

COMMENT ON TRIGGER jobs_result_readable ON __SCHEMA__.jobs IS
    'Refuses a result nested deeper than 127 levels (leasehold could not read it back).';
COMMENT ON TRIGGER jobs_progress_readable ON __SCHEMA__.jobs IS
    'Refuses progress nested deeper than 127 levels (leasehold could not read it back).';
COMMENT ON TRIGGER effects_outcome_readable ON __SCHEMA__.effects IS
    'Refuses an effect outcome nested deeper than 127 levels (a retry could not read it back).';
