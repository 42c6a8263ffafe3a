#!/usr/bin/env bash
# Outage figures (by hand, not CI): three gateways on one redis-server share a per-key bucket of
# 2 a second with a burst of 20. The key is drained, then Redis hangs (SIGSTOP) for HANG seconds
# (default 10) while the key sends 10 requests a second (five times its rate) round robin over
# the three gateways; then Redis resumes (SIGCONT) and, once every gateway decides on the store
# again, the key sends 20 requests at once. Printed for each --on-store-error mode: admitted
# during the hang, admitted in the burst after it, and the bound local mode promises for the
# hang (the last known remaining, 0, plus rate x T, plus one request per gateway).
#
# Mode `base` runs the binary TG_BASE names (an earlier build, without local mode) instead.
#
# Usage: [TG=target/release/tollgate] [TG_BASE=/path/to/old/tollgate] [HANG=10]
#        [MODES="open local"] bash benches/outage.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TG=${TG:-target/release/tollgate}
HANG=${HANG:-10}
MODES=${MODES:-"open local"}
[ -x "$TG" ] || cargo build --release --quiet --bin tollgate
WORK=$(mktemp -d)
REDIS_PORT=18970; UP=18971
cleanup() {
  [ -f "$WORK/redis.pid" ] && kill -CONT "$(cat "$WORK/redis.pid")" 2>/dev/null || true
  jobs -p | xargs -r kill 2>/dev/null || true
  [ -f "$WORK/redis.pid" ] && kill "$(cat "$WORK/redis.pid")" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# The upstream: a Python HTTP server answering 200.
python3 -c '
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "3"); self.end_headers(); self.wfile.write(b"ok\n")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()' $UP &
until curl -s -o /dev/null 127.0.0.1:$UP/; do sleep 0.1; done

cat > "$WORK/policy.json" <<'JSON'
{"rules": [{"name": "per-key", "limit_keys": ["header:x-api-key"],
  "algorithm": "token_bucket", "algorithm_config": {"rps": 2, "burst": 20}}]}
JSON

status() { # gateway index, key
  curl -s -o /dev/null -w '%{http_code}' -H "X-Api-Key: $2" "127.0.0.1:$((18980 + $1))/"
}

for mode in $MODES; do
  redis-server --port $REDIS_PORT --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" \
    --daemonize yes --pidfile "$WORK/redis.pid" >/dev/null
  until redis-cli -p $REDIS_PORT ping >/dev/null 2>&1; do sleep 0.1; done
  pids=()
  bin=$TG; flags=(--on-store-error "$mode"); ready='"fleet_gateways":3'
  back='"store_mode":"shared","store_status":"ok"'
  if [ "$mode" = base ]; then
    bin=$TG_BASE; flags=(); ready='"store_status":"ok"'; back=$ready
  fi
  for i in 0 1 2; do
    "$bin" run --policy "$WORK/policy.json" --upstream 127.0.0.1:$UP \
      --listen 127.0.0.1:$((18980 + i)) --admin-listen 127.0.0.1:$((18990 + i)) \
      --store redis://127.0.0.1:$REDIS_PORT --store-timeout-ms 50 "${flags[@]}" \
      2> "$WORK/gw-$mode-$i.log" &
    pids+=($!)
  done
  for i in 0 1 2; do
    until curl -s 127.0.0.1:$((18990 + i))/readyz | grep -q "$ready"; do sleep 0.2; done
  done
  drained=0
  while [ "$(status $((drained % 3)) k)" = 200 ]; do drained=$((drained + 1)); done
  kill -STOP "$(cat "$WORK/redis.pid")"
  during=0; started=$(date +%s.%N)
  for n in $(seq 0 $((HANG * 10 - 1))); do
    due=$(echo "$started + $n / 10" | bc -l)
    wait_s=$(echo "$due - $(date +%s.%N)" | bc -l)
    [ "$(echo "$wait_s > 0" | bc -l)" = 1 ] && sleep "$wait_s"
    [ "$(status $((n % 3)) k)" = 200 ] && during=$((during + 1))
  done
  hang=$(echo "$(date +%s.%N) - $started" | bc -l)
  kill -CONT "$(cat "$WORK/redis.pid")"
  for i in 0 1 2; do
    until status $i other >/dev/null && curl -s 127.0.0.1:$((18990 + i))/readyz \
      | grep -q "$back"; do sleep 0.1; done
  done
  after=0
  for n in $(seq 0 19); do [ "$(status $((n % 3)) k)" = 200 ] && after=$((after + 1)); done
  bound=$(echo "2 * $hang + 3" | bc -l)
  printf '%-6s drained %2d; during a %.1f s hang: %3d of %d admitted (local bound %.0f); burst after: %2d of 20\n' \
    "$mode" "$drained" "$hang" "$during" $((HANG * 10)) "$bound" "$after"
  kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true
  kill "$(cat "$WORK/redis.pid")"; rm -f "$WORK/redis.pid"
  sleep 0.5
done
