#!/usr/bin/env bash
# gRPC rate-limit service load (by hand, not CI): tollgate with --threads 1 pinned to core 1,
# examples/rls_load.rs on core 0 driving ShouldRateLimit over one HTTP/2 connection (as one
# Envoy worker does). Per round: saturated (CONCURRENCY calls in flight) for calls/s per core
# and server CPU per call, and one call at a time for the unloaded latency Envoy's 20 ms
# timeout is measured against. Medians of ROUNDS rounds.
#
# Usage: bash benches/grpc.sh [rounds=3] [seconds=5] [concurrency=32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}; SECS=${2:-5}; CONC=${3:-32}
cargo build --profile perf --quiet --bin tollgate --example rls_load
WORK=$(mktemp -d)
echo '{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000000, "burst": 1000000000}}]}' > "$WORK/one.json"
taskset -c 1 target/perf/tollgate run --policy "$WORK/one.json" --admin-listen 127.0.0.1:18940 \
  --grpc-listen 127.0.0.1:18941 --threads 1 2>"$WORK/tg.log" &
PID=$!
trap 'kill $PID 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 1.5
for round in $(seq 1 "$ROUNDS"); do
  echo "round $round saturated (c=$CONC): $(taskset -c 0 target/perf/examples/rls_load 127.0.0.1:18941 "$CONC" "$SECS" $PID)"
  echo "round $round one at a time (c=1): $(taskset -c 0 target/perf/examples/rls_load 127.0.0.1:18941 1 "$SECS" $PID)"
done
