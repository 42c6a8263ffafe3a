#!/usr/bin/env bash
# CPU per unary gRPC call through a proxy, one core each: tollgate (an "h2c" upstream group,
# --h2c, one worker thread) against Envoy (--concurrency 1, an HTTP/2 upstream cluster), each
# pinned to core 1 alone; the echo gRPC server and the load client (examples/grpc_proxy_load.rs,
# tonic) share core 0. Each target: with nothing limited, and with one per-client limit that
# never refuses (tollgate: one token_bucket rule on ip:address; Envoy: local_ratelimit). Rounds
# are interleaved; the proxy's own CPU (every thread, /proc/PID/stat) is divided by the calls.
#
# Usage: [PROFILE=release] bash benches/grpc-proxy.sh [seconds=10] [concurrency=16] [rounds=3]
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${PROFILE:-release}
SECS=${1:-10}
CONC=${2:-16}
ROUNDS=${3:-3}
cargo build --profile "$PROFILE" --quiet --bin tollgate --example grpc_proxy_load
TG=target/$PROFILE/tollgate
LOAD=target/$PROFILE/examples/grpc_proxy_load
ENVOY=${TOLLGATE_ENVOY:-$(bash scripts/install-envoy.sh)}
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

UP=18970; TG_NONE=18971; TG_ONE=18972; ENVOY_NONE=18973; ENVOY_LR=18974
wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never listened" >&2; exit 1; }

taskset -c 0 "$LOAD" serve "127.0.0.1:$UP" & PIDS+=($!)
wait_port $UP

cat > "$WORK/routes.json" <<JSON
{"upstreams": {"echo": {"servers": ["127.0.0.1:$UP"], "protocol": "h2c"}}, "default_upstream": "echo"}
JSON
echo '{"rules": []}' > "$WORK/none.json"
echo '{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000000, "burst": 1000000000}}]}' > "$WORK/one.json"
start_tollgate() { # port, policy, admin port
  taskset -c 1 "$TG" run --policy "$2" --routes "$WORK/routes.json" --listen "127.0.0.1:$1" --h2c \
    --admin-listen "127.0.0.1:$3" --threads 1 2>"$WORK/tg-$1.log" >/dev/null &
  PIDS+=($!); LAST_PID=$!
}
start_tollgate $TG_NONE "$WORK/none.json" 18981; PID_TG_NONE=$LAST_PID
start_tollgate $TG_ONE "$WORK/one.json" 18982; PID_TG_ONE=$LAST_PID

envoy_conf() { # port, extra http filter
  cat <<YAML
static_resources:
  listeners:
  - name: grpc
    address: { socket_address: { address: 127.0.0.1, port_value: $1 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: grpc
          codec_type: AUTO
          route_config:
            virtual_hosts:
            - { name: all, domains: ["*"], routes: [ { match: { prefix: "/" }, route: { cluster: echo } } ] }
          http_filters:
$2
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: echo
    connect_timeout: 1s
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: echo
      endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $UP } } } } ] } ]
YAML
}
LR='          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: rl
              token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
              filter_enabled: { runtime_key: rl_enabled, default_value: { numerator: 100, denominator: HUNDRED } }
              filter_enforced: { runtime_key: rl_enforced, default_value: { numerator: 100, denominator: HUNDRED } }'
envoy_conf $ENVOY_NONE "" > "$WORK/envoy-none.yaml"
envoy_conf $ENVOY_LR "$LR" > "$WORK/envoy-lr.yaml"
taskset -c 1 "$ENVOY" -c "$WORK/envoy-none.yaml" --concurrency 1 -l error --base-id 11 > "$WORK/envoy-none.log" 2>&1 &
PIDS+=($!); PID_ENVOY_NONE=$!
taskset -c 1 "$ENVOY" -c "$WORK/envoy-lr.yaml" --concurrency 1 -l error --base-id 12 > "$WORK/envoy-lr.log" 2>&1 &
PIDS+=($!); PID_ENVOY_LR=$!
for port in $TG_NONE $TG_ONE $ENVOY_NONE $ENVOY_LR; do wait_port "$port"; done

declare -A RESULTS
for round in $(seq "$ROUNDS"); do
  for target in "tollgate-none $TG_NONE $PID_TG_NONE" "tollgate-1-rule $TG_ONE $PID_TG_ONE" \
                "envoy-none $ENVOY_NONE $PID_ENVOY_NONE" "envoy-local-ratelimit $ENVOY_LR $PID_ENVOY_LR"; do
    set -- $target
    line=$(taskset -c 0 "$LOAD" load "127.0.0.1:$2" "$CONC" "$SECS" "$3")
    echo "round $round $1: $line"
    RESULTS[$1]+="$(echo "$line" | sed -n 's/.*proxy CPU µs\/call \([0-9.]*\).*/\1/p') "
  done
done
echo
echo "| proxy (one core) | CPU µs per unary call, median of $ROUNDS |"
echo "|---|---|"
for name in tollgate-none tollgate-1-rule envoy-none envoy-local-ratelimit; do
  median=$(echo "${RESULTS[$name]}" | tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  echo "| $name | $median |"
done
