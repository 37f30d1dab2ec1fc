//! A database clock a test shifts, with no seam in the library.
//!
//! [`install_sql`] creates a schema of `now()`, `clock_timestamp()`,
//! `statement_timestamp()` and `transaction_timestamp()` functions that return
//! PostgreSQL's own plus a shift kept in that schema's `shift` table. Sessions that put
//! the schema before `pg_catalog` in their `search_path` (a pool connected with
//! `.options([("search_path", "<clock>,pg_catalog")])`) call those instead of the
//! built-in ones. leasehold's SQL names its tables by schema and calls the clock
//! functions unqualified, so everything such a pool runs reads the shifted clock (the
//! schema's column defaults are pointed at it too), while the host's clock stays what it
//! is: the database is "ahead" or "behind", or in a daylight-saving night of the test's
//! choosing, without sleeping. Move it with
//! `UPDATE <clock>.shift SET secs = …` (it runs on from there).

/// The SQL that installs clock schema `clock` for leasehold schema `schema` (both plain
/// lower-case identifiers; `schema` migrated already), its shift starting at
/// `initial_secs` (an SQL expression, e.g. `0`). Everything is granted to `PUBLIC`.
pub fn install_sql(clock: &str, schema: &str, initial_secs: &str) -> String {
    let s = clock;
    let mut sql = format!(
        "CREATE SCHEMA {s};
         CREATE TABLE {s}.shift (secs float8 NOT NULL);
         INSERT INTO {s}.shift SELECT {initial_secs};
         GRANT USAGE ON SCHEMA {s} TO PUBLIC;
         GRANT SELECT ON {s}.shift TO PUBLIC;"
    );
    for (f, volatility) in [
        ("now", "STABLE"),
        ("transaction_timestamp", "STABLE"),
        ("statement_timestamp", "STABLE"),
        ("clock_timestamp", "VOLATILE"),
    ] {
        sql.push_str(&format!(
            "CREATE FUNCTION {s}.{f}() RETURNS timestamptz LANGUAGE sql {volatility} AS
             $$ SELECT pg_catalog.{f}()
                  + pg_catalog.make_interval(secs => (SELECT secs FROM {s}.shift)) $$;
             GRANT EXECUTE ON FUNCTION {s}.{f}() TO PUBLIC;"
        ));
    }
    // Column defaults were bound to the built-in functions when the tables were created:
    // point them at the clock's, so every time the schema writes is read from one clock
    // (retention, say, compares `enqueued_at` with `clock_timestamp()`). The catalogs are
    // read for this schema's tables only, and each default is deparsed in the loop's
    // body, never in a filter the planner may run first: deparsing a default of another
    // schema's table while it is being dropped fails ("cache lookup failed for
    // function"), which `information_schema.columns` (deparsing every default in the
    // database) ran into.
    sql.push_str(&format!(
        "DO $do$ DECLARE r record; def text; BEGIN
           FOR r IN SELECT c.relname, a.attname, d.adbin, d.adrelid
                    FROM pg_catalog.pg_attrdef d
                    JOIN pg_catalog.pg_class c ON c.oid = d.adrelid
                    JOIN pg_catalog.pg_attribute a
                      ON a.attrelid = d.adrelid AND a.attnum = d.adnum
                    WHERE c.relnamespace = '{schema}'::regnamespace LOOP
             def := pg_catalog.pg_get_expr(r.adbin, r.adrelid);
             CONTINUE WHEN def !~ '(now|clock_timestamp)[(][)]';
             EXECUTE format('ALTER TABLE %I.%I ALTER COLUMN %I SET DEFAULT %s',
               '{schema}', r.relname, r.attname,
               replace(replace(def, 'clock_timestamp()', '{s}.clock_timestamp()'),
                       'now()', '{s}.now()'));
           END LOOP;
         END $do$;"
    ));
    sql
}
