#!/usr/bin/env bash
# Edge harness (by hand, not CI): HTTPS and HTTP/2 through tollgate against nginx doing the same,
# and the cost of access logs. Same fairness rules as benches/load.sh: the proxy under test on
# core 1, the upstream (its own nginx) and the load generator on core 0, CPU per request read
# from the proxy's own process, rounds interleaved, medians reported.
#
# Targets (1 per-IP limit that never refuses, on every proxy):
#   nginx-tls      nginx, HTTPS (HTTP/1.1) + limit_req            wrk over TLS
#   tg-tls         tollgate, HTTPS (HTTP/1.1)                      wrk over TLS
#   nginx-h2       nginx, HTTPS + HTTP/2 + limit_req               h2load (-c 8 -m 16)
#   tg-h2          tollgate, HTTPS + HTTP/2                        h2load (-c 8 -m 16)
#   tg-h2c         tollgate, h2c (cleartext HTTP/2)                h2load (-c 8 -m 16)
#   tg-plain       tollgate, cleartext HTTP/1.1, no access log     wrk
#   tg-log-text    the same with --access-log text (to /dev/null)  wrk
#   tg-log-json    the same with --access-log json (to /dev/null)  wrk
#
# Usage: bash benches/edge.sh [rounds=3] [seconds=5] [connections=32]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benches/common.sh
source benches/common.sh
ROUNDS=${1:-3}; SECS=${2:-5}; CONNS=${3:-32}
bash scripts/install-deps.sh --load
cargo build --profile perf --quiet --bin tollgate
TG=target/perf/tollgate
CERT=$PWD/tests/fixtures/tls/api.pem; KEY=$PWD/tests/fixtures/tls/api.key

UP=18950; NGX_TLS=18951; NGX_H2=18952; TG_TLS=18953; TG_H2C=18954; TG_PLAIN=18955; TG_TEXT=18956; TG_JSON=18957

nginx_conf upstream "server { listen 127.0.0.1:$UP; keepalive_requests 100000; location / { return 200 \"ok\\n\"; } }"
taskset -c 0 /usr/sbin/nginx -p "$WORK" -c "$WORK/upstream.conf"
PROXY='proxy_http_version 1.1; proxy_set_header Connection ""; proxy_pass http://backend;'
TLS="ssl_certificate $CERT; ssl_certificate_key $KEY; ssl_protocols TLSv1.2 TLSv1.3; keepalive_requests 100000;"
nginx_conf front "
  limit_req_zone \$binary_remote_addr zone=perip:10m rate=100000000r/s;
  upstream backend { server 127.0.0.1:$UP; keepalive 256; }
  server { listen 127.0.0.1:$NGX_TLS ssl; $TLS location / { limit_req zone=perip burst=1000000 nodelay; $PROXY } }
  server { listen 127.0.0.1:$NGX_H2 ssl http2; $TLS location / { limit_req zone=perip burst=1000000 nodelay; $PROXY } }
"
taskset -c 1 /usr/sbin/nginx -p "$WORK" -c "$WORK/front.conf"

echo '{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000000, "burst": 1000000000}}]}' > "$WORK/one.json"
start_tollgate() { # admin port, extra args...: sets LAST_PID
  local admin=$1; shift
  taskset -c 1 $TG run --policy "$WORK/one.json" --upstream "127.0.0.1:$UP" --admin-listen "127.0.0.1:$admin" \
    --threads 1 "$@" 2>"$WORK/tg-$admin.log" >/dev/null &
  LAST_PID=$!; PIDS+=("$LAST_PID")
}
start_tollgate 18960 --listen "127.0.0.1:$TG_TLS" --tls-cert "$CERT" --tls-key "$KEY"; PID_TG_TLS=$LAST_PID
start_tollgate 18961 --listen "127.0.0.1:$TG_H2C" --h2c; PID_TG_H2C=$LAST_PID
start_tollgate 18962 --listen "127.0.0.1:$TG_PLAIN"; PID_TG_PLAIN=$LAST_PID
start_tollgate 18963 --listen "127.0.0.1:$TG_TEXT" --access-log text; PID_TG_TEXT=$LAST_PID
start_tollgate 18964 --listen "127.0.0.1:$TG_JSON" --access-log json; PID_TG_JSON=$LAST_PID
sleep 2
NGX_WORKER=$(pgrep -P "$(cat "$WORK/front.pid")" | head -1)

declare -A RPS CPU
TARGETS=${TARGETS:-"nginx-tls tg-tls nginx-h2 tg-h2 tg-h2c tg-plain tg-log-text tg-log-json"}
for round in $(seq 1 "$ROUNDS"); do
  for t in $TARGETS; do
    case $t in
      nginx-tls) url="https://127.0.0.1:$NGX_TLS/v1/orders"; pid=$NGX_WORKER; tool=wrk;;
      tg-tls) url="https://127.0.0.1:$TG_TLS/v1/orders"; pid=$PID_TG_TLS; tool=wrk;;
      nginx-h2) url="https://127.0.0.1:$NGX_H2/v1/orders"; pid=$NGX_WORKER; tool=h2load;;
      tg-h2) url="https://127.0.0.1:$TG_TLS/v1/orders"; pid=$PID_TG_TLS; tool=h2load;;
      tg-h2c) url="http://127.0.0.1:$TG_H2C/v1/orders"; pid=$PID_TG_H2C; tool=h2load;;
      tg-plain) url="http://127.0.0.1:$TG_PLAIN/v1/orders"; pid=$PID_TG_PLAIN; tool=wrk;;
      tg-log-text) url="http://127.0.0.1:$TG_TEXT/v1/orders"; pid=$PID_TG_TEXT; tool=wrk;;
      tg-log-json) url="http://127.0.0.1:$TG_JSON/v1/orders"; pid=$PID_TG_JSON; tool=wrk;;
    esac
    before=$(cpu_ticks "$pid")
    if [ "$tool" = wrk ]; then
      out=$(taskset -c 0 wrk -t1 -c"$CONNS" -d"${SECS}s" "$url")
      rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
      total=$(echo "$out" | awk '/requests in/ {print $1}')
    else
      out=$(taskset -c 0 h2load -t1 -c8 -m16 -D"$SECS" "$url" 2>&1)
      rps=$(echo "$out" | awk '/^finished in/ {gsub(",", "", $4); print $4}')
      total=$(echo "$out" | awk '/^requests:/ {print $8}')
    fi
    after=$(cpu_ticks "$pid")
    us=$(awk -v d=$((after - before)) -v n="$total" -v k="$TICK_US" 'BEGIN { printf "%.1f", d * k / n }')
    RPS[$t]+="$rps "; CPU[$t]+="$us "
    printf 'round %s %-12s %10s req/s %6s µs CPU/req\n' "$round" "$t" "$rps" "$us"
  done
done
declare -A MC
echo; echo "| target | median req/s | median proxy CPU µs/req | runs (µs/req) |"; echo "|---|---|---|---|"
for t in $TARGETS; do
  MC[$t]=$(echo "${CPU[$t]}" | median)
  echo "| $t | $(echo "${RPS[$t]}" | median) | ${MC[$t]} | ${CPU[$t]% } |"
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }
echo
echo "tollgate / nginx, HTTPS HTTP/1.1, CPU per request: $(ratio "${MC[tg-tls]:-0}" "${MC[nginx-tls]:-0}")"
echo "tollgate / nginx, HTTPS HTTP/2,   CPU per request: $(ratio "${MC[tg-h2]:-0}" "${MC[nginx-h2]:-0}")"
echo "access log text / off, CPU per request:          $(ratio "${MC[tg-log-text]:-0}" "${MC[tg-plain]:-0}")"
echo "access log json / off, CPU per request:          $(ratio "${MC[tg-log-json]:-0}" "${MC[tg-plain]:-0}")"
