#!/usr/bin/env bash
# Instructions per request, in user space, under callgrind (by hand, not CI): repeatable to a
# fraction of a percent where CPU time on this VM swings ±20 %. Each target runs alone under
# valgrind; after a warm-up the counters are zeroed, wrk sends requests for a while, and the
# instructions counted are divided by the requests served. The kernel's share (about half of
# the CPU time, loopback TCP) is not counted here: see benches/load.sh for CPU time.
#
# Usage: [KEEP=dir] bash benches/instructions.sh [seconds=8] [BINARY=target/perf/tollgate]
# (KEEP keeps each profile for `callgrind_annotate --inclusive=yes`.)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-8}
TG=${2:-target/perf/tollgate}
BARE=target/perf/examples/bare_proxy
bash scripts/install-deps.sh --load
[ "$TG" = target/perf/tollgate ] && cargo build --profile perf --quiet --bin tollgate --example bare_proxy
command -v valgrind >/dev/null || { echo "instructions.sh: needs valgrind" >&2; exit 1; }
WORK=$(mktemp -d)
cleanup() { [ -f "$WORK/up.pid" ] && kill "$(cat "$WORK/up.pid")" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
USER_LINE=""; [ "$(id -u)" = 0 ] && USER_LINE="user root;"
cat > "$WORK/up.conf" <<NGINX
$USER_LINE
worker_processes 1;
pid $WORK/up.pid;
error_log $WORK/up.log error;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path $WORK/cb; proxy_temp_path $WORK/px;
  fastcgi_temp_path $WORK/fc; uwsgi_temp_path $WORK/uw; scgi_temp_path $WORK/sc;
  server { listen 127.0.0.1:18950; keepalive_requests 100000; location / { return 200 "ok\n"; } } }
NGINX
/usr/sbin/nginx -p "$WORK" -c "$WORK/up.conf"
rule() { printf '{"rules": [{"name": "%s", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": %s, "burst": %s}}]}' "$1" "$2" "$3"; }
rule per-ip 1000000000 1000000000 > "$WORK/one.json"
rule deny 0.000001 1 > "$WORK/deny.json"

measure() { # name, command...
  local name=$1; shift
  valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.%p" "$@" >/dev/null 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do curl -s -o /dev/null "http://127.0.0.1:18951/" && break; sleep 0.5; done
  wrk -t1 -c4 -d3s -H 'X-Api-Key: k' http://127.0.0.1:18951/v1/orders >/dev/null
  callgrind_control -z "$pid" >/dev/null 2>&1
  local out; out=$(wrk -t1 -c4 -d"${SECS}s" -H 'X-Api-Key: k' http://127.0.0.1:18951/v1/orders)
  callgrind_control -d "$pid" >/dev/null 2>&1
  kill -INT "$pid" 2>/dev/null; sleep 1; kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  local n; n=$(echo "$out" | awk '/requests in/ {print $1}')
  # The dump taken after zeroing has the highest part number.
  local dump; dump=$(ls -v "$WORK"/cg."$pid"* | tail -1)
  local ir; ir=$(awk '/^summary:/ {print $2}' "$dump")
  awk -v name="$name" -v ir="$ir" -v n="$n" 'BEGIN { printf "| %s | %d | %.0f |\n", name, n, ir / n }'
  # Keep the profile for callgrind_annotate when asked (KEEP=dir).
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP"; cp "$dump" "$KEEP/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '-').callgrind"; fi
  rm -f "$WORK"/cg."$pid"*
}

echo "| target | requests | user-space instructions per request |"
echo "|---|---|---|"
measure "bare Pingora proxy" $BARE 127.0.0.1:18951 127.0.0.1:18950
measure "tollgate, no policy" $TG run --policy "$WORK/none.json" --wait-for-policy --listen 127.0.0.1:18951 --upstream 127.0.0.1:18950 --admin-listen 127.0.0.1:18952 --threads 1
measure "tollgate, 1 per-IP rule" $TG run --policy "$WORK/one.json" --listen 127.0.0.1:18951 --upstream 127.0.0.1:18950 --admin-listen 127.0.0.1:18952 --threads 1
measure "bare Pingora, 429 with the same headers" $BARE 127.0.0.1:18951 127.0.0.1:18950 --refuse
measure "tollgate, every request refused" $TG run --policy "$WORK/deny.json" --listen 127.0.0.1:18951 --upstream 127.0.0.1:18950 --admin-listen 127.0.0.1:18952 --threads 1
