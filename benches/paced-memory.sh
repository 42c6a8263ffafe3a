#!/usr/bin/env bash
# What waiting requests cost: N clients (default 10 000) each send one request that a
# token-bucket rule's `delay` makes wait (one global bucket, one request per 100 s, a burst of
# N + 1: a first request goes at once, then request i waits about i × 100 s), and the gateway's resident memory and CPU time are read from /proc
# before, once they all wait, over 10 s of waiting, and after their clients leave (each gives its
# token back).
#
# Usage: bash benches/paced-memory.sh [N=10000] [BINARY=target/release/tollgate]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10000}
TG=${2:-target/release/tollgate}
[ -x "$TG" ] || cargo build --release --quiet --bin tollgate
WORK=$(mktemp -d)
TG_PID=""
cleanup() {
  [ -n "$TG_PID" ] && kill "$TG_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
cat > "$WORK/paced.json" <<EOF
{"rules": [{"name": "paced", "limit_keys": [], "algorithm": "token_bucket",
  "algorithm_config": {"rps": 0.01, "burst": $((N + 1)), "delay": {"immediate": 1}}}]}
EOF
ADMIN=127.0.0.1:18991
"$TG" run --policy "$WORK/paced.json" --listen 127.0.0.1:18990 --admin-listen "$ADMIN" \
  --upstream 127.0.0.1:9 --threads 2 --max-delayed-requests "$N" 2> "$WORK/tg.log" &
TG_PID=$!
timeout 30 bash -c "until curl -sf $ADMIN/readyz > /dev/null; do sleep 0.1; done"
rss_kib() { awk '/^VmRSS/ { print $2 }' "/proc/$TG_PID/status"; }
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$TG_PID/stat"; }
waiting() { curl -s "$ADMIN/metrics" | awk '/^tollgate_paced_waiting / { print $2 }'; }
TICK=$(getconf CLK_TCK)
# The first request goes at once (to a closed port: 502) and warms the path.
curl -s -o /dev/null 127.0.0.1:18990/ || true
sleep 1
RSS0=$(rss_kib); CPU0=$(cpu_ticks)
python3 - "$N" "$WORK/go" <<'PY' &
import os, resource, socket, sys, time
n, flag = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
conns = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", 18990))
    s.sendall(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
    conns.append(s)
while not os.path.exists(flag):
    time.sleep(0.1)
for s in conns:
    s.close()
PY
CLIENTS=$!
# Until every request waits, or their number stops growing for 3 s (a connection the kernel's
# accept queue dropped never arrives): W is the number measured.
W=0; SAME=0
while [ "$W" != "$N" ] && [ $SAME -lt 15 ]; do
  sleep 0.2; NOW=$(waiting)
  if [ "$NOW" = "$W" ]; then SAME=$((SAME + 1)); else SAME=0; W=$NOW; fi
done
RSS1=$(rss_kib); CPU1=$(cpu_ticks)
sleep 10
RSS2=$(rss_kib); CPU2=$(cpu_ticks)
touch "$WORK/go"
wait "$CLIENTS"
timeout 60 bash -c "until [ \"\$(curl -s $ADMIN/metrics | awk '/^tollgate_paced_waiting / { print \$2 }')\" = 0 ]; do sleep 0.2; done"
sleep 1
RSS3=$(rss_kib); CPU3=$(cpu_ticks)
GONE=$(curl -s "$ADMIN/metrics" | awk -F' ' '/^tollgate_paced_requests_total\{outcome="client_gone"\}/ { print $2 }')
echo "waiting requests: $W of $N sent (client_gone afterwards: $GONE)"
echo "RSS before: $((RSS0 / 1024)) MiB; all waiting: $((RSS1 / 1024)) MiB; after 10 s: $((RSS2 / 1024)) MiB; after they left: $((RSS3 / 1024)) MiB"
echo "per waiting request: $(( (RSS1 - RSS0) * 1024 / W )) bytes"
echo "CPU to admit them: $(( (CPU1 - CPU0) * 1000 / TICK )) ms; while they wait: $(( (CPU2 - CPU1) * 100 / TICK )) ms per second over 10 s; their leaving: $(( (CPU3 - CPU2) * 1000 / TICK )) ms"
