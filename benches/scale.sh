#!/usr/bin/env bash
# Large bundles, black-box (by hand, not CI): the decision service on one worker thread, one
# keep-alive client (wrk -c1), gateway CPU per decision read from its own process
# (/proc/PID/stat), the same request each time while only the bundle grows: one-rule policies
# selected by path prefix or by host, rules of one policy tiered by `match` (header:x-tier), and
# kill switches on header:x-api-key (a block list the request is not on). Also the gateway's
# resident memory once the bundle is loaded, and how long a SIGHUP reload of it takes.
#
# Usage: [PROFILE=release] bash benches/scale.sh [seconds=5] [sizes="1 1000 10000"] [ks_sizes="1 10000 100000"]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benches/common.sh
source benches/common.sh
SECS=${1:-5}; SIZES=${2:-"1 1000 10000"}; KS_SIZES=${3:-"1 10000 100000"}
PROFILE=${PROFILE:-release}
bash scripts/install-deps.sh --load
cargo build --profile "$PROFILE" --quiet --bin tollgate
TG=target/$PROFILE/tollgate
PORT=18950

bundle() { # kind, n > file
  python3 - "$1" "$2" <<'PY'
import json, sys
kind, n = sys.argv[1], int(sys.argv[2])
rule = lambda name, extra={}: dict({"name": name, "limit_keys": ["ip:address"], "algorithm": "token_bucket",
    "algorithm_config": {"rps": 1000000, "burst": 1000000}}, **extra)
if kind == "paths":
    b = {"policies": [{"id": f"p{i}", "spec": {"selector": {"pathPrefix": f"/p{i}"}, "rules": [rule(f"r{i}")]}} for i in range(n)]}
elif kind == "hosts":
    b = {"policies": [{"id": f"h{i}", "spec": {"selector": {"hosts": [f"h{i}.example.com"]}, "rules": [rule(f"r{i}")]}} for i in range(n)]}
elif kind == "tiers":
    b = {"policies": [{"id": "tiers", "spec": {"rules": [rule(f"t{i}", {"match": {"header:x-tier": f"t{i}"}}) for i in range(n)]}}]}
else:
    b = {"kill_switches": [{"scope_key": "header:x-api-key", "scope_value": f"blocked-{i}", "reason": "abuse"} for i in range(n)],
         "policies": [{"id": "p", "spec": {"rules": [rule("per-ip")]}}]}
b["bundle_version"] = 1
json.dump(b, sys.stdout)
PY
}

echo "| bundle | entries | CPU µs per decision | decisions/s | RSS MB | reload ms |"
echo "|---|---|---|---|---|---|"
for kind in paths hosts tiers kill_switches; do
  sizes=$SIZES; [ "$kind" = kill_switches ] && sizes=$KS_SIZES
  for n in $sizes; do
    bundle "$kind" "$n" > "$WORK/policy.json"
    taskset -c 1 $TG run --policy "$WORK/policy.json" --admin-listen "127.0.0.1:$PORT" --threads 1 \
      --policy-poll-secs 0 2>"$WORK/tg.log" &
    pid=$!; PIDS+=("$pid")
    for _ in $(seq 1 200); do curl -sf "127.0.0.1:$PORT/readyz" >/dev/null && break; sleep 0.1; done
    case $kind in
      paths) uri="/p0/orders"; host="api.example.com";;
      hosts) uri="/v1/orders"; host="h0.example.com";;
      *) uri="/v1/orders"; host="api.example.com";;
    esac
    cat > "$WORK/post.lua" <<LUA
wrk.method = "POST"
wrk.headers["X-Original-URI"] = "$uri"
wrk.headers["X-Original-Host"] = "$host"
wrk.headers["Host"] = "$host"
wrk.headers["X-Forwarded-For"] = "203.0.113.7"
wrk.headers["X-Api-Key"] = "bench-key"
wrk.headers["X-Tier"] = "t0"
LUA
    status=$(curl -s -o /dev/null -w '%{http_code}' -XPOST -H "X-Original-URI: $uri" -H "Host: $host" \
      -H 'X-Forwarded-For: 203.0.113.7' -H 'X-Api-Key: bench-key' -H 'X-Tier: t0' "127.0.0.1:$PORT/v1/decision")
    [ "$status" = 200 ] || { echo "decision answered $status for $kind/$n" >&2; cat "$WORK/tg.log" >&2; exit 1; }
    rss=$(awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$pid/status")
    before=$(cpu_ticks $pid)
    out=$(taskset -c 0 wrk -t1 -c1 -d"${SECS}s" -s "$WORK/post.lua" "http://127.0.0.1:$PORT/v1/decision")
    after=$(cpu_ticks $pid)
    total=$(echo "$out" | awk '/requests in/ {print $1}')
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    us=$(awk -v d=$((after - before)) -v n="$total" -v k="$TICK_US" 'BEGIN { printf "%.1f", d * k / n }')
    # A reload of the same bundle (SIGHUP): from the signal to the log line that it is loaded.
    lines=$(grep -c "policy loaded" "$WORK/tg.log" || true)
    start=$(date +%s%N); kill -HUP $pid
    for _ in $(seq 1 400); do [ "$(grep -c "policy loaded" "$WORK/tg.log" || true)" -gt "$lines" ] && break; sleep 0.005; done
    reload_ms=$(( ($(date +%s%N) - start) / 1000000 ))
    echo "| $kind | $n | $us | $rps | $rss | $reload_ms |"
    kill $pid; wait $pid 2>/dev/null || true
  done
done
