#!/usr/bin/env bash
# Instructions per request, in user space, under callgrind: repeatable to a fraction of a
# percent where CPU time on this VM swings ±20 %. Each target runs alone under valgrind; after a
# warm-up the counters are zeroed, wrk sends requests for a while, and the instructions counted
# are divided by the requests served. The kernel's share (about half of the CPU time, loopback
# TCP) is not counted here: see benches/load.sh for CPU time.
#
# Usage: [PROFILE=perf|release|shipped] [KEEP=dir] [TRACES=1] bash benches/instructions.sh [seconds=8] [BINARY]
#   (PROFILE=shipped: scripts/shipped-build.sh's build, the image's; any other name is that cargo
#   profile.)
#   (KEEP keeps each profile for `callgrind_annotate --inclusive=yes`; TRACES=1 adds the one-rule
#   path with traces on, OTEL_TRACES_SAMPLER=always_on, exporting over OTLP/HTTP to
#   examples/otlp_sink.rs, which decodes every batch outside valgrind.)
# The gate CI runs (the shipped build; tollgate's no-policy, one-rule and refusal paths against
# benches/instructions-baseline.txt; exit 1 when one costs over 3 % more):
#   bash benches/instructions.sh --check
#   bash benches/instructions.sh --write-baseline    (after a change that is meant to cost more
#                                                     or less; commit the file with its reason)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=table
case "${1:-}" in
  --check) MODE=check; shift;;
  --write-baseline) MODE=write; shift;;
esac
BASELINE=benches/instructions-baseline.txt
if [ "$MODE" != table ]; then PROFILE=shipped; fi
PROFILE=${PROFILE:-perf}
BIN_DIR=target/$PROFILE; SINK_PROFILE=$PROFILE
[ "$PROFILE" = shipped ] && { BIN_DIR=target/shipped/release; SINK_PROFILE=release; }
SECS=${1:-8}
[ "$MODE" != table ] && SECS=4
TG=${2:-$BIN_DIR/tollgate}
BARE=$BIN_DIR/examples/bare_proxy
bash scripts/install-deps.sh --load
if [ "$TG" = "$BIN_DIR/tollgate" ]; then
  if [ "$PROFILE" = shipped ]; then bash scripts/shipped-build.sh
  else cargo build --profile "$PROFILE" --quiet --bin tollgate --example bare_proxy; fi
fi
# The OTLP receiver runs outside valgrind: any build of it will do.
[ -n "${TRACES:-}" ] && cargo build --profile "$SINK_PROFILE" --quiet --example otlp_sink
command -v valgrind >/dev/null || { echo "instructions.sh: needs valgrind" >&2; exit 1; }
WORK=$(mktemp -d)
SINK_PID=""
cleanup() {
  [ -f "$WORK/up.pid" ] && kill "$(cat "$WORK/up.pid")" 2>/dev/null
  [ -n "$SINK_PID" ] && kill "$SINK_PID" 2>/dev/null
  rm -rf "$WORK"
}
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

declare -A IR
measure() { # id, name, command...
  local id=$1 name=$2; shift 2
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
  IR[$id]=$(awk -v ir="$ir" -v n="$n" 'BEGIN { printf "%.0f", ir / n }')
  printf '| %s | %d | %s |\n' "$name" "$n" "${IR[$id]}"
  # Keep the profile for callgrind_annotate when asked (KEEP=dir).
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP"; cp "$dump" "$KEEP/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '-').callgrind"; fi
  rm -f "$WORK"/cg."$pid"*
}

echo "| target | requests | user-space instructions per request |"
echo "|---|---|---|"
TG_ARGS=(--listen 127.0.0.1:18951 --upstream 127.0.0.1:18950 --admin-listen 127.0.0.1:18952 --threads 1)
if [ "$MODE" = table ]; then
  measure bare "bare Pingora proxy" $BARE 127.0.0.1:18951 127.0.0.1:18950
fi
measure none "tollgate, no policy" $TG run --policy "$WORK/none.json" --wait-for-policy "${TG_ARGS[@]}"
measure one "tollgate, 1 per-IP rule" $TG run --policy "$WORK/one.json" "${TG_ARGS[@]}"
if [ "$MODE" = table ]; then
  measure bare429 "bare Pingora, 429 with the same headers" $BARE 127.0.0.1:18951 127.0.0.1:18950 --refuse
fi
measure refused "tollgate, every request refused" $TG run --policy "$WORK/deny.json" "${TG_ARGS[@]}"
if [ "$MODE" = table ] && [ -n "${TRACES:-}" ]; then
  "target/$SINK_PROFILE/examples/otlp_sink" 127.0.0.1:18953 2>"$WORK/sink.log" &
  SINK_PID=$!
  # (Set for the function, so valgrind itself starts tollgate with them: valgrind does not
  # follow an exec through env.)
  OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:18953 OTEL_TRACES_SAMPLER=always_on \
    measure traced "tollgate, 1 per-IP rule, traces always_on" $TG run --policy "$WORK/one.json" "${TG_ARGS[@]}"
  echo "OTLP receiver: $(tail -1 "$WORK/sink.log")"
fi

case $MODE in
  write)
    { echo "# User-space instructions per request (benches/instructions.sh --check compares against"
      echo "# these; a path over 3 % above its line fails CI). The shipped build (scripts/shipped-build.sh),"
      echo "# made with --write-baseline."
      for id in none one refused; do echo "$id ${IR[$id]}"; done; } > "$BASELINE"
    echo "instructions.sh: wrote $BASELINE";;
  check)
    failed=0
    for id in none one refused; do
      base=$(awk -v id="$id" '$1 == id {print $2}' "$BASELINE")
      [ -n "$base" ] || { echo "instructions.sh: $BASELINE has no line for $id" >&2; exit 1; }
      verdict=$(awk -v now="${IR[$id]}" -v base="$base" 'BEGIN {
        d = (now - base) * 100 / base; printf "%+.2f %%", d; if (d > 3) print " REGRESSION" }')
      echo "$id: ${IR[$id]} instructions per request, baseline $base ($verdict)"
      case $verdict in *REGRESSION*) failed=1;; esac
    done
    [ $failed = 0 ] || { echo "instructions.sh: over 3 % more instructions per request than the baseline" >&2; exit 1; };;
esac
