#!/usr/bin/env bash
# One fix of the hardening reverted at a time in the library (the rest kept); the short
# chaos profile (seed 20240605) must catch each. Patches src/ in place and restores it
# with git, so it refuses to run on a tree whose src/ has uncommitted changes.
# Usage: examples/chaos/reverts.sh [OUT_DIR]   (about 4 x 3 minutes; summary in OUT_DIR/summary)
set -u
cd "$(dirname "$0")/../.."
if ! git diff --quiet -- src; then echo "src/ has uncommitted changes; commit or stash them first" >&2; exit 2; fi
out=${1:-target/chaos-reverts}; mkdir -p "$out"; : > "$out/summary"
run() {
  name=$1; shift
  git checkout -q -- src
  python3 - "$@" <<'PY'
import sys
args=sys.argv[1:]
for i in range(0,len(args),3):
    p,a,b=args[i:i+3]
    s=open(p).read()
    assert a in s, (p,a)
    s=s.replace(a,b)
    open(p,'w').write(s)
PY
  timeout 900 cargo build -q --example chaos 2>"$out"/$name.build || { echo "$name: build failed" >> "$out"/summary; return; }
  timeout 600 target/debug/examples/chaos short --seed 20240605 > "$out"/$name.log 2>&1
  echo "== $name (rc $?)" >> "$out"/summary
  grep -E "^violations|RESULT" "$out"/$name.log | tail -2 >> "$out"/summary
}
run renewal_waits src/store/lease.rs "FOR UPDATE OF j SKIP LOCKED" "FOR UPDATE OF j"
run cancel_promotes_at_once src/store/admin.rs "if job.state == JobState::Running {" "if job.state == JobState::Running && false {"
run no_local_deadline src/executor.rs "async fn lease_watch(ctx: &JobContext) {
    loop {" "async fn lease_watch(ctx: &JobContext) {
    std::future::pending::<()>().await;
    #[allow(unreachable_code)]
    loop {"
run prune_deletes_dead src/store/admin.rs "state IN ('done', 'cancelled')
    ORDER BY finished_at" "state IN ('done', 'cancelled', 'dead')
    ORDER BY finished_at" src/store/admin.rs "j.state IN ('done', 'cancelled')" "j.state IN ('done', 'cancelled', 'dead')"
git checkout -q -- src
echo done >> "$out"/summary
