#!/usr/bin/env bash
# Load harness (by hand, not CI): wrk against four targets on loopback, in interleaved rounds,
# all in front of the same nginx upstream:
#   (a) nginx proxy_pass   (b) nginx proxy_pass + limit_req (never rejecting)
#   (c) tollgate, no policy loaded   (d) tollgate, one per-IP rule that never rejects
# Prints per-round req/s and proxy CPU µs per request, then medians and the ratios (d)/(b) and
# (d)/(c). Usage: bash benches/load.sh [rounds=5] [seconds=5] [connections=32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}; SECS=${2:-5}; CONNS=${3:-32}
bash scripts/install-deps.sh --load
cargo build --profile perf --quiet
BIN=target/perf/tollgate
WORK=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; [ -f $WORK/nginx.pid ] && kill $(cat $WORK/nginx.pid) 2>/dev/null; rm -rf $WORK' EXIT
USER_LINE=""; [ "$(id -u)" = 0 ] && USER_LINE="user root;"
cat > $WORK/nginx.conf <<NGINX
$USER_LINE
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/error.log error;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/cb; proxy_temp_path $WORK/px; fastcgi_temp_path $WORK/fc; uwsgi_temp_path $WORK/uw; scgi_temp_path $WORK/sc;
  limit_req_zone \$binary_remote_addr zone=perip:10m rate=100000000r/s;
  upstream backend { server 127.0.0.1:18900; keepalive 256; }
  server { listen 127.0.0.1:18900; location / { return 200 "ok\n"; } }
  server { listen 127.0.0.1:18901; location / { proxy_http_version 1.1; proxy_set_header Connection ""; proxy_pass http://backend; } }
  server { listen 127.0.0.1:18902; location / { limit_req zone=perip burst=1000000 nodelay;
           proxy_http_version 1.1; proxy_set_header Connection ""; proxy_pass http://backend; } }
}
NGINX
# The upstream nginx has its own worker; the proxies under test get one core each in turn.
/usr/sbin/nginx -p $WORK -c $WORK/nginx.conf
cat > $WORK/per-ip.json <<'JSON'
{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
            "algorithm_config": {"rps": 1000000000, "burst": 1000000000}}]}
JSON
$BIN run --policy $WORK/none.json --listen 127.0.0.1:18903 --upstream 127.0.0.1:18900 --admin-listen 127.0.0.1:18913 --threads 1 2>/dev/null & PID_C=$!
$BIN run --policy $WORK/per-ip.json --listen 127.0.0.1:18904 --upstream 127.0.0.1:18900 --admin-listen 127.0.0.1:18914 --threads 1 2>/dev/null & PID_D=$!
sleep 2
NGINX_WORKER=$(pgrep -P "$(cat $WORK/nginx.pid)" | head -1)
cpu_ticks() { awk '{print $14+$15}' /proc/$1/stat; }
declare -A RPS CPU
for round in $(seq 1 "$ROUNDS"); do
  for t in a b c d; do
    case $t in a) port=18901; pid=$NGINX_WORKER;; b) port=18902; pid=$NGINX_WORKER;; c) port=18903; pid=$PID_C;; d) port=18904; pid=$PID_D;; esac
    before=$(cpu_ticks "$pid")
    out=$(wrk -t1 -c"$CONNS" -d"${SECS}s" "http://127.0.0.1:$port/")
    after=$(cpu_ticks "$pid")
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    total=$(echo "$out" | awk '/requests in/ {print $1}')
    # nginx's single worker serves both the proxy and the upstream: its CPU covers both for
    # (a)/(b); tollgate's covers the proxy only. Ticks are 10 ms.
    us=$(awk -v d=$((after - before)) -v n="$total" 'BEGIN { printf "%.1f", d * 10000 / n }')
    RPS[$t]+="$rps "; CPU[$t]+="$us "
    printf 'round %s %s: %10s req/s  %6s µs CPU/req\n' "$round" "$t" "$rps" "$us"
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
echo; echo "| target | median req/s | median CPU µs/req |"; echo "|---|---|---|"
for t in a b c d; do
  case $t in a) name="(a) nginx proxy_pass";; b) name="(b) nginx + limit_req";; c) name="(c) tollgate, no policy";; d) name="(d) tollgate, 1 per-IP rule";; esac
  r=$(echo "${RPS[$t]}" | median); c=$(echo "${CPU[$t]}" | median); eval "MED_$t=$r"
  echo "| $name | $r | $c |"
done
awk -v d="$MED_d" -v b="$MED_b" -v c="$MED_c" 'BEGIN { printf "\n(d)/(b) = %.2f   (d)/(c) = %.2f\n", d/b, d/c }'
