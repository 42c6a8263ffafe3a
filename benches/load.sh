#!/usr/bin/env bash
# Fair load harness (by hand, not CI). The proxy under test has core 1 to itself; the upstream
# (its own nginx process) and wrk share core 0; CPU per request is read from the proxy's own
# process (/proc/PID/stat, every thread), so the upstream's work never counts. Rounds are
# interleaved (every target once per round) and medians reported: CPU µs per request is steady
# here, req/s swings ±20 %.
#
# Targets (all in front of the same upstream, wrk -t1 -cCONNS, every request carrying
# X-Api-Key so the 5-rule policy has its key):
#   nginx          nginx proxy_pass
#   nginx-lr       nginx proxy_pass + limit_req (per-IP, never refusing)
#   envoy-lr       Envoy (--concurrency 1) + local_ratelimit (never refusing)
#   bare           a bare Pingora proxy built like tollgate (examples/bare_proxy.rs)
#   bare-429       the same, answering every request itself with tollgate's 429 headers
#   tg-none        tollgate, no policy loaded
#   tg-1           tollgate, 1 per-IP rule (5 RateLimit headers)
#   tg-5           tollgate, 5 rules (IP, key, key+path, global, 1 shadow)
#   tg-1-state     tg-1 with its buckets in a state dir (--state-dir): what surviving restarts costs
#   tg-1-otel      tg-1 with traces on: OTEL_TRACES_SAMPLER=always_on, exporting over OTLP/HTTP to
#                  a live receiver (examples/otlp_sink.rs, on core 0) that counts every batch's
#                  spans from its protobuf framing and decodes one batch in OTLP_DECODE_EVERY (16)
#                  in full (its work on core 0 slows the proxy's core: see performance.md)
#   tg-1-otel-ratio  the same with parentbased_traceidratio at 0.01
#   tg-1-otel-down tg-1-otel with its collector down (nothing listens); its resident memory, and
#                  tg-1's, are printed after the table
#   nginx-429      nginx limit_req refusing every request (limit_req_status 429)
#   tg-429         tollgate refusing every request
#   authreq        nginx auth_request → tollgate decision service (CPU: nginx + tollgate)
#   envoy-rls      Envoy (--concurrency 1) + global ratelimit filter → tollgate's gRPC
#                  RateLimitService (1 per-IP rule, never refusing; CPU: Envoy + tollgate, both
#                  on core 1), against envoy-lr: what the gRPC round trip costs per request
# Then, once: the decision service alone with --threads 2 and no pinning (cores used,
# decisions/s, decisions per CPU-second).
#
#   tg-redis       tg-1 on a Redis store (redis-server on core 0, with wrk and the upstream)
#   tg-cluster     tg-1 on a 3-node Redis Cluster (core 0)
#   tg-pg          tg-1 on PostgreSQL (core 0; needs Debian's postgresql, run as `postgres`)
#                  The shared-store targets start their servers only when named in TARGETS;
#                  every store error (a request failed open) is reported after the table.
#   tg-1-base, tg-429-base, tg-redis-base, tg-cluster-base, tg-pg-base
#                  the same targets run by the binary TG_BASE names (an earlier build),
#                  interleaved with this build's: what a change costs, in one run
#   bare-base, bare-429-base
#                  bare and bare-429 run by the bare_proxy binary BARE_BASE names (built from the
#                  same earlier tree as TG_BASE), so that both ratios to bare Pingora are like-for-like
# With LATENCY=1, each target is then also run at 1, 32 and 256 connections (wrk --latency),
# and its p50 and p99 latencies printed.
#
# PROFILE: a cargo profile (perf, the default: fat LTO; release), or `shipped`: the image's
# build, scripts/shipped-build.sh (release, optimised with the committed profile pgo/).
# Usage: [TARGETS="tg-1 tg-1-state"] [PROFILE=perf] [TG_BASE=/path/to/old/tollgate]
#        [BARE_BASE=/path/to/old/bare_proxy]
#        bash benches/load.sh [rounds=3] [seconds=5] [connections=32]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benches/common.sh
source benches/common.sh
ROUNDS=${1:-3}; SECS=${2:-5}; CONNS=${3:-32}
bash scripts/install-deps.sh --load
# PROFILE=release skips the fat-LTO build (minutes) for a quick comparison between targets.
PROFILE=${PROFILE:-perf}
TARGETS=${TARGETS:-"nginx nginx-lr envoy-lr bare tg-none tg-1 tg-1-state tg-5 tg-redis nginx-429 bare-429 tg-429 authreq envoy-rls"}
wants() { [[ " ${TARGETS:-} " == *" $1 "* ]]; }
# Only what the targets need is built and started (the OTLP receiver, Envoy).
EXAMPLES=(--example bare_proxy)
SINK_PROFILE=$PROFILE
if [ "$PROFILE" = shipped ]; then
  # The image's build (scripts/shipped-build.sh), both proxies from its one profile; the OTLP
  # receiver, which is not measured, from the release profile.
  bash scripts/shipped-build.sh
  TG=target/shipped/release/tollgate
  BARE=target/shipped/release/examples/bare_proxy
  SINK_PROFILE=release
  { wants tg-1-otel || wants tg-1-otel-ratio; } && cargo build --release --quiet --example otlp_sink
else
  { wants tg-1-otel || wants tg-1-otel-ratio; } && EXAMPLES+=(--example otlp_sink)
  cargo build --profile "$PROFILE" --quiet --bin tollgate "${EXAMPLES[@]}"
  TG=target/$PROFILE/tollgate
  BARE=target/$PROFILE/examples/bare_proxy
fi
ENVOY=""
{ wants envoy-lr || wants envoy-rls; } && ENVOY=$(bash scripts/install-envoy.sh)

# Ports.
UP=18900; NGX=18901; NGX_LR=18902; NGX_429=18903; AUTHREQ=18904; ENVOY_PORT=18905; BARE_PORT=18906
BARE_429=18907; BARE_BASE_PORT=18908; BARE_429_BASE=18909
TG_NONE=18910; TG_1=18911; TG_5=18912; TG_429=18913; TG_DEC=18914; ENVOY_RLS=18915; TG_GRPC=18916
TG_1_STATE=18918; TG_1_BASE=18919; TG_429_BASE=18926
TG_1_OTEL=18943; TG_1_OTEL_RATIO=18944; TG_1_OTEL_DOWN=18945; OTLP_PORT=18946; OTLP_DOWN=18947
TG_REDIS=18931; TG_CLUSTER=18932; TG_PG=18933; REDIS_PORT=18960; CLUSTER_PORTS="18961 18962 18963"
PG_PORT=18964

# The upstream: its own nginx, on core 0 with wrk.
nginx_conf upstream "server { listen 127.0.0.1:$UP; keepalive_requests 100000; location / { return 200 \"ok\\n\"; } }"
taskset -c 0 /usr/sbin/nginx -p "$WORK" -c "$WORK/upstream.conf"

# The nginx under test: one worker on core 1 serving every nginx target (one loaded at a time).
PROXY='proxy_http_version 1.1; proxy_set_header Connection ""; proxy_pass http://backend;'
nginx_conf front "
  limit_req_zone \$binary_remote_addr zone=perip:10m rate=100000000r/s;
  limit_req_zone \$binary_remote_addr zone=deny:10m rate=1r/m;
  upstream backend { server 127.0.0.1:$UP; keepalive 256; }
  upstream tollgate { server 127.0.0.1:$TG_DEC; keepalive 256; }
  server { listen 127.0.0.1:$NGX; keepalive_requests 100000; location / { $PROXY } }
  server { listen 127.0.0.1:$NGX_LR; keepalive_requests 100000; location / { limit_req zone=perip burst=1000000 nodelay; $PROXY } }
  server { listen 127.0.0.1:$NGX_429; keepalive_requests 100000; location / { limit_req zone=deny; limit_req_status 429; $PROXY } }
  server { listen 127.0.0.1:$AUTHREQ; keepalive_requests 100000;
    location / { auth_request /_tollgate; $PROXY }
    location = /_tollgate { internal; proxy_method POST; proxy_pass_request_body off;
      proxy_set_header Content-Length \"\"; proxy_set_header X-Original-URI \$request_uri;
      proxy_set_header X-Forwarded-For \$remote_addr; proxy_http_version 1.1;
      proxy_set_header Connection \"\"; proxy_pass http://tollgate/v1/decision; } }
"
taskset -c 1 /usr/sbin/nginx -p "$WORK" -c "$WORK/front.conf"

cat > "$WORK/envoy.yaml" <<YAML
static_resources:
  listeners:
  - name: bench
    address: { socket_address: { address: 127.0.0.1, port_value: $ENVOY_PORT } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          route_config:
            virtual_hosts:
            - { name: all, domains: ["*"], routes: [ { match: { prefix: "/" }, route: { cluster: upstream } } ] }
          http_filters:
          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: rl
              token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
              filter_enabled: { runtime_key: rl_enabled, default_value: { numerator: 100, denominator: HUNDRED } }
              filter_enforced: { runtime_key: rl_enforced, default_value: { numerator: 100, denominator: HUNDRED } }
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: upstream
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: upstream
      endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $UP } } } } ] } ]
YAML
if [ -n "$ENVOY" ]; then
  taskset -c 1 "$ENVOY" -c "$WORK/envoy.yaml" --concurrency 1 -l error > "$WORK/envoy.log" 2>&1 &
  PID_ENVOY=$!; PIDS+=("$PID_ENVOY")
fi

# Envoy with the global rate-limit filter asking tollgate's gRPC listener (TG_GRPC).
cat > "$WORK/envoy-rls.yaml" <<YAML
static_resources:
  listeners:
  - name: bench
    address: { socket_address: { address: 127.0.0.1, port_value: $ENVOY_RLS } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          use_remote_address: true
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              rate_limits: [ { actions: [ { remote_address: {} } ] } ]
              routes: [ { match: { prefix: "/" }, route: { cluster: upstream } } ]
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: bench
              rate_limit_service:
                transport_api_version: V3
                grpc_service: { envoy_grpc: { cluster_name: tollgate } }
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: upstream
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: upstream
      endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $UP } } } } ] } ]
  - name: tollgate
    connect_timeout: 1s
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: tollgate
      endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $TG_GRPC } } } } ] } ]
YAML
if [ -n "$ENVOY" ]; then
  taskset -c 1 "$ENVOY" -c "$WORK/envoy-rls.yaml" --concurrency 1 -l error --base-id 7 > "$WORK/envoy-rls.log" 2>&1 &
  PID_ENVOY_RLS=$!; PIDS+=("$PID_ENVOY_RLS")
fi

bench_policies

start_tollgate() { # port, policy, admin port, extra flags...: sets LAST_PID
  taskset -c 1 "${TG_RUN:-$TG}" run --policy "$2" --listen "127.0.0.1:$1" --upstream "127.0.0.1:$UP" \
    --admin-listen "127.0.0.1:$3" --threads 1 "${@:4}" 2>"$WORK/tg-$1.log" >/dev/null &
  LAST_PID=$!; PIDS+=("$LAST_PID")
}
start_tollgate $TG_NONE "$WORK/missing.json" 18920 --wait-for-policy; PID_TG_NONE=$LAST_PID
start_tollgate $TG_1 "$WORK/one.json" 18921; PID_TG_1=$LAST_PID
start_tollgate $TG_5 "$WORK/five.json" 18922; PID_TG_5=$LAST_PID
start_tollgate $TG_429 "$WORK/deny.json" 18923; PID_TG_429=$LAST_PID
start_tollgate $TG_1_STATE "$WORK/one.json" 18924 --state-dir "$WORK/state"; PID_TG_1_STATE=$LAST_PID
if [ -n "${TG_BASE:-}" ]; then
  TG_RUN=$TG_BASE start_tollgate $TG_1_BASE "$WORK/one.json" 18927; PID_TG_1_BASE=$LAST_PID
  TG_RUN=$TG_BASE start_tollgate $TG_429_BASE "$WORK/deny.json" 18928; PID_TG_429_BASE=$LAST_PID
fi
# Traced tollgates: OTLP/HTTP to the receiver on core 0 (or to a port nobody listens on).
start_traced() { # port, admin port, OTLP port, sampler, sampler argument: sets LAST_PID
  env OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$3" OTEL_TRACES_SAMPLER="$4" \
    OTEL_TRACES_SAMPLER_ARG="$5" taskset -c 1 "$TG" run --policy "$WORK/one.json" \
    --listen "127.0.0.1:$1" --upstream "127.0.0.1:$UP" --admin-listen "127.0.0.1:$2" --threads 1 \
    2>"$WORK/tg-$1.log" >/dev/null &
  LAST_PID=$!; PIDS+=("$LAST_PID")
}
if wants tg-1-otel || wants tg-1-otel-ratio; then
  taskset -c 0 "target/$SINK_PROFILE/examples/otlp_sink" "127.0.0.1:$OTLP_PORT" --decode-every "${OTLP_DECODE_EVERY:-16}" 2>"$WORK/otlp.log" &
  PIDS+=("$!")
fi
wants tg-1-otel && { start_traced $TG_1_OTEL 18948 $OTLP_PORT always_on 1; PID_TG_1_OTEL=$LAST_PID; }
wants tg-1-otel-ratio && { start_traced $TG_1_OTEL_RATIO 18949 $OTLP_PORT parentbased_traceidratio 0.01; PID_TG_1_OTEL_RATIO=$LAST_PID; }
wants tg-1-otel-down && { start_traced $TG_1_OTEL_DOWN 18952 $OTLP_DOWN always_on 1; PID_TG_1_OTEL_DOWN=$LAST_PID; }
redis_on() { # port, extra flags...: a redis-server on core 0, without persistence
  mkdir -p "$WORK/redis-$1"
  taskset -c 0 redis-server --port "$1" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$WORK/redis-$1" --daemonize yes --pidfile "$WORK/redis-$1.pid" "${@:2}" >/dev/null
}
# A shared store's gateway: its own admin port (for its store-error count), a 100 ms store
# deadline so a loaded core never fails a request open.
start_shared() { # port, admin port, store URL
  start_tollgate "$1" "$WORK/one.json" "$2" --store "$3" --store-timeout-ms 100
  for _ in $(seq 1 100); do
    curl -s "127.0.0.1:$2/readyz" | grep -q '"store_status":"ok"' && return 0; sleep 0.1
  done
  echo "load.sh: the gateway on $3 never connected" >&2; exit 1
}
if wants tg-redis || wants tg-redis-base; then
  redis_on $REDIS_PORT
  start_shared $TG_REDIS 18934 "redis://127.0.0.1:$REDIS_PORT"; PID_TG_REDIS=$LAST_PID
fi
if wants tg-cluster || wants tg-cluster-base; then
  for p in $CLUSTER_PORTS; do redis_on "$p" --cluster-enabled yes --cluster-config-file "$WORK/nodes-$p.conf"; done
  sleep 0.5
  # shellcheck disable=SC2086
  redis-cli --cluster create $(for p in $CLUSTER_PORTS; do printf '127.0.0.1:%s ' "$p"; done) \
    --cluster-replicas 0 --cluster-yes >/dev/null
  for _ in $(seq 1 100); do
    redis-cli -p 18961 cluster info | grep -q cluster_state:ok && break; sleep 0.1
  done
  start_shared $TG_CLUSTER 18935 "redis+cluster://127.0.0.1:18961,127.0.0.1:18962,127.0.0.1:18963"
  PID_TG_CLUSTER=$LAST_PID
fi
if wants tg-pg || wants tg-pg-base; then
  PG_BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  mkdir -p "$WORK/pg"; [ "$(id -u)" = 0 ] && chown -R postgres:postgres "$WORK/pg" && chmod 755 "$WORK"
  as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
  as_pg "$PG_BIN/initdb" -U tollgate --auth=trust -E UTF8 -D "$WORK/pg/data" >/dev/null
  as_pg taskset -c 0 "$PG_BIN/postgres" -D "$WORK/pg/data" -p $PG_PORT -c listen_addresses=127.0.0.1 \
    -c fsync=off -c synchronous_commit=off -k "$WORK/pg" >/dev/null 2>&1 &
  PIDS+=("$!")
  for _ in $(seq 1 100); do "$PG_BIN/pg_isready" -h 127.0.0.1 -p $PG_PORT >/dev/null && break; sleep 0.1; done
  start_shared $TG_PG 18936 "postgres://tollgate@127.0.0.1:$PG_PORT/postgres"; PID_TG_PG=$LAST_PID
fi
if [ -n "${TG_BASE:-}" ]; then
  wants tg-redis-base && { TG_RUN=$TG_BASE start_shared 18937 18940 "redis://127.0.0.1:$REDIS_PORT"; PID_TG_REDIS_BASE=$LAST_PID; }
  wants tg-cluster-base && { TG_RUN=$TG_BASE start_shared 18938 18941 "redis+cluster://127.0.0.1:18961,127.0.0.1:18962,127.0.0.1:18963"; PID_TG_CLUSTER_BASE=$LAST_PID; }
  wants tg-pg-base && { TG_RUN=$TG_BASE start_shared 18939 18942 "postgres://tollgate@127.0.0.1:$PG_PORT/postgres"; PID_TG_PG_BASE=$LAST_PID; }
fi
# The decision service for nginx auth_request: its admin listener on TG_DEC.
taskset -c 1 $TG run --policy "$WORK/one.json" --admin-listen "127.0.0.1:$TG_DEC" --threads 1 2>"$WORK/tg-dec.log" &
PID_TG_DEC=$!; PIDS+=("$PID_TG_DEC")
# The gRPC rate-limit service for envoy-rls.
taskset -c 1 $TG run --policy "$WORK/one.json" --admin-listen 127.0.0.1:18917 --grpc-listen "127.0.0.1:$TG_GRPC" --threads 1 2>"$WORK/tg-grpc.log" &
PID_TG_GRPC=$!; PIDS+=("$PID_TG_GRPC")
taskset -c 1 $BARE "127.0.0.1:$BARE_PORT" "127.0.0.1:$UP" 2>/dev/null &
PID_BARE=$!; PIDS+=("$PID_BARE")
taskset -c 1 $BARE "127.0.0.1:$BARE_429" "127.0.0.1:$UP" --refuse 2>/dev/null &
PID_BARE_429=$!; PIDS+=("$PID_BARE_429")
if [ -n "${BARE_BASE:-}" ]; then
  taskset -c 1 "$BARE_BASE" "127.0.0.1:$BARE_BASE_PORT" "127.0.0.1:$UP" 2>/dev/null &
  PID_BARE_BASE=$!; PIDS+=("$PID_BARE_BASE")
  taskset -c 1 "$BARE_BASE" "127.0.0.1:$BARE_429_BASE" "127.0.0.1:$UP" --refuse 2>/dev/null &
  PID_BARE_429_BASE=$!; PIDS+=("$PID_BARE_429_BASE")
fi
sleep 2
NGX_WORKER=$(pgrep -P "$(cat "$WORK/front.pid")" | head -1)


declare -A RPS CPU SHARE
# Each round starts one target further along the list, so that no target always runs first or
# last in its round (a target's place in a round moved its CPU per request by several per cent).
read -r -d '' -a TARGET_LIST <<< "$TARGETS" || true
[ ${#TARGET_LIST[@]} -gt 0 ] || { echo "load.sh: TARGETS names no target" >&2; exit 1; }
for round in $(seq 1 "$ROUNDS"); do
  shift_by=$(( (round - 1) % ${#TARGET_LIST[@]} ))
  for t in "${TARGET_LIST[@]:$shift_by}" "${TARGET_LIST[@]:0:$shift_by}"; do
    case $t in
      nginx) port=$NGX; pids=$NGX_WORKER;;
      nginx-lr) port=$NGX_LR; pids=$NGX_WORKER;;
      envoy-lr) port=$ENVOY_PORT; pids=$PID_ENVOY;;
      bare) port=$BARE_PORT; pids=$PID_BARE;;
      tg-none) port=$TG_NONE; pids=$PID_TG_NONE;;
      tg-1) port=$TG_1; pids=$PID_TG_1;;
      tg-5) port=$TG_5; pids=$PID_TG_5;;
      tg-1-state) port=$TG_1_STATE; pids=$PID_TG_1_STATE;;
      tg-1-otel) port=$TG_1_OTEL; pids=$PID_TG_1_OTEL;;
      tg-1-otel-ratio) port=$TG_1_OTEL_RATIO; pids=$PID_TG_1_OTEL_RATIO;;
      tg-1-otel-down) port=$TG_1_OTEL_DOWN; pids=$PID_TG_1_OTEL_DOWN;;
      nginx-429) port=$NGX_429; pids=$NGX_WORKER;;
      bare-429) port=$BARE_429; pids=$PID_BARE_429;;
      tg-429) port=$TG_429; pids=$PID_TG_429;;
      tg-redis) port=$TG_REDIS; pids=$PID_TG_REDIS;;
      tg-cluster) port=$TG_CLUSTER; pids=$PID_TG_CLUSTER;;
      tg-pg) port=$TG_PG; pids=$PID_TG_PG;;
      tg-redis-base) port=18937; pids=$PID_TG_REDIS_BASE;;
      tg-cluster-base) port=18938; pids=$PID_TG_CLUSTER_BASE;;
      tg-pg-base) port=18939; pids=$PID_TG_PG_BASE;;
      tg-1-base) port=$TG_1_BASE; pids=$PID_TG_1_BASE;;
      tg-429-base) port=$TG_429_BASE; pids=$PID_TG_429_BASE;;
      bare-base) port=$BARE_BASE_PORT; pids=$PID_BARE_BASE;;
      bare-429-base) port=$BARE_429_BASE; pids=$PID_BARE_429_BASE;;
      authreq) port=$AUTHREQ; pids="$NGX_WORKER $PID_TG_DEC";;
      envoy-rls) port=$ENVOY_RLS; pids="$PID_ENVOY_RLS $PID_TG_GRPC";;
    esac
    last_pid=${pids##* }
    last_before=$(cpu_ticks "$last_pid")
    # shellcheck disable=SC2086
    before=$(cpu_ticks $pids)
    out=$(taskset -c 0 wrk -t1 -c"$CONNS" -d"${SECS}s" -H 'X-Api-Key: bench-key' "http://127.0.0.1:$port/v1/orders")
    # shellcheck disable=SC2086
    after=$(cpu_ticks $pids)
    last_after=$(cpu_ticks "$last_pid")
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    total=$(echo "$out" | awk '/requests in/ {print $1}')
    us=$(awk -v d=$((after - before)) -v n="$total" -v k="$TICK_US" 'BEGIN { printf "%.1f", d * k / n }')
    RPS[$t]+="$rps "; CPU[$t]+="$us "
    SHARE[$t]+="$(awk -v d=$((last_after - last_before)) -v n="$total" -v k="$TICK_US" 'BEGIN { printf "%.1f", d * k / n }') "
    printf 'round %s %-10s %10s req/s %6s µs CPU/req\n' "$round" "$t" "$rps" "$us"
  done
done

declare -A MR MC
echo; echo "| target | median req/s | median proxy CPU µs/req | runs (µs/req) |"; echo "|---|---|---|---|"
for t in $TARGETS; do
  MR[$t]=$(echo "${RPS[$t]}" | median); MC[$t]=$(echo "${CPU[$t]}" | median)
  case $t in
    nginx) name="nginx proxy_pass";;
    nginx-lr) name="nginx proxy_pass + limit_req";;
    envoy-lr) name="Envoy 1.40 (1 worker) + local_ratelimit";;
    bare) name="bare Pingora proxy, same build";;
    tg-none) name="tollgate, no policy";;
    tg-1) name="tollgate, 1 per-IP rule (5 RateLimit headers)";;
    tg-5) name="tollgate, 5 rules";;
    tg-1-state) name="tollgate, 1 rule, --state-dir";;
    tg-1-otel) name="tollgate, 1 rule, traces always_on, live OTLP receiver";;
    tg-1-otel-ratio) name="tollgate, 1 rule, traces parentbased_traceidratio 0.01";;
    tg-1-otel-down) name="tollgate, 1 rule, traces always_on, collector down";;
    nginx-429) name="nginx limit_req, every request refused (429)";;
    bare-429) name="bare Pingora, every request refused (429, same headers)";;
    bare-base) name="BARE_BASE, bare Pingora proxy";;
    bare-429-base) name="BARE_BASE, every request refused (429)";;
    tg-429) name="tollgate, every request refused (429)";;
    tg-redis) name="tollgate, 1 rule, Redis store";;
    tg-cluster) name="tollgate, 1 rule, Redis Cluster (3 nodes)";;
    tg-pg) name="tollgate, 1 rule, PostgreSQL store";;
    tg-redis-base) name="TG_BASE, 1 rule, Redis store";;
    tg-cluster-base) name="TG_BASE, 1 rule, Redis Cluster";;
    tg-pg-base) name="TG_BASE, 1 rule, PostgreSQL store";;
    tg-1-base) name="TG_BASE, 1 per-IP rule";;
    tg-429-base) name="TG_BASE, every request refused (429)";;
    authreq) name="nginx auth_request → tollgate (nginx + tollgate CPU)";;
    envoy-rls) name="Envoy ratelimit filter → tollgate gRPC (Envoy + tollgate CPU)";;
  esac
  echo "| $name | ${MR[$t]} | ${MC[$t]} | ${CPU[$t]% } |"
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
# One line per pair of targets that ran (a TARGETS subset leaves the others out).
line() { # label, numerator target, denominator target, [note], [req/s instead of CPU]
  local a b
  if [ -n "${5:-}" ]; then a=${MR[$2]:-}; b=${MR[$3]:-}; else a=${MC[$2]:-}; b=${MC[$3]:-}; fi
  [ -n "$a" ] && [ -n "$b" ] && printf '%-58s %s  %s\n' "$1" "$(ratio "$a" "$b")" "${4:-}"
  return 0
}
echo
line "tollgate 1 rule / nginx + limit_req, CPU per request:" tg-1 nginx-lr "(target ≤ 1.15)"
line "tollgate 1 rule / Envoy local_ratelimit, CPU per request:" tg-1 envoy-lr "(target ≤ 0.6)"
line "tollgate 429 / nginx limit_req 429, CPU per refusal:" tg-429 nginx-429 "(target ≤ 1.0)"
line "tollgate limiter on / off, req/s:" tg-1 tg-none "(target ≥ 0.97)" rps
line "tollgate limiter on / off, CPU per request:" tg-1 tg-none
line "tollgate no policy / bare Pingora, CPU per request:" tg-none bare
line "tollgate 1 rule, state dir / in memory, CPU per request:" tg-1-state tg-1 "(target ≤ 1.05)"
line "tollgate 429 / bare Pingora 429, CPU per refusal:" tg-429 bare-429
line "tollgate 1 rule / bare Pingora, CPU per request:" tg-1 bare
line "Redis / embedded store, 1 rule, CPU per request:" tg-redis tg-1 "(target ≤ 1.3)"
line "Redis Cluster / embedded store, 1 rule, CPU per request:" tg-cluster tg-1 "(target ≤ 1.3)"
line "PostgreSQL / embedded store, 1 rule, CPU per request:" tg-pg tg-1 "(target ≤ 1.3)"
for t in tg-redis tg-cluster tg-pg; do
  wants $t || continue
  case $t in tg-redis) a=18934;; tg-cluster) a=18935;; tg-pg) a=18936;; esac
  errors=$(curl -s "127.0.0.1:$a/metrics" | awk '/^tollgate_store_errors_total/ {print $2}')
  echo "$t: store errors (requests failed open) during the run: ${errors:-0}"
done
line "traces always_on / off, 1 rule, CPU per request:" tg-1-otel tg-1 "(target ≤ 1.10)"
line "traces ratio 0.01 / off, 1 rule, CPU per request:" tg-1-otel-ratio tg-1
line "traces always_on, collector down / off, CPU per request:" tg-1-otel-down tg-1
for t in tg-1 tg-1-otel tg-1-otel-down; do
  case $t in tg-1) pid=$PID_TG_1;; tg-1-otel) pid=${PID_TG_1_OTEL:-};; tg-1-otel-down) pid=${PID_TG_1_OTEL_DOWN:-};; esac
  wants "$t" && [ -n "$pid" ] && echo "$t: resident memory after the run: $(awk '/VmRSS/ {print $2, $3}' "/proc/$pid/status")"
done
if wants tg-1-otel-down; then
  echo "tg-1-otel-down: spans not exported (dropped: queue full, failed batch or back-off): $(curl -s 127.0.0.1:18952/metrics | awk '/^tollgate_trace_spans_dropped_total/ {print $2}')"
fi
if wants tg-1-otel; then
  echo "tg-1-otel: spans dropped: $(curl -s 127.0.0.1:18948/metrics | awk '/^tollgate_trace_spans_dropped_total/ {print $2}'); $(tail -1 "$WORK/otlp.log")"
fi
line "this build / TG_BASE, Redis, CPU per request:" tg-redis tg-redis-base
line "this build / TG_BASE, Redis Cluster, CPU per request:" tg-cluster tg-cluster-base
line "this build / TG_BASE, PostgreSQL, CPU per request:" tg-pg tg-pg-base
line "this build / TG_BASE, 1 rule, CPU per request:" tg-1 tg-1-base
line "this build / TG_BASE, refusal, CPU per request:" tg-429 tg-429-base
line "TG_BASE 1 rule / BARE_BASE, CPU per request:" tg-1-base bare-base
line "TG_BASE 429 / BARE_BASE 429, CPU per refusal:" tg-429-base bare-429-base
if [ -n "${LATENCY:-}" ]; then
  echo; echo "| target | connections | req/s | p50 | p99 |"; echo "|---|---|---|---|---|"
  for t in $TARGETS; do
    case $t in
      tg-1) port=$TG_1;; tg-redis) port=$TG_REDIS;; tg-cluster) port=$TG_CLUSTER;; tg-pg) port=$TG_PG;;
      tg-redis-base) port=18937;; tg-cluster-base) port=18938;; tg-pg-base) port=18939;;
      tg-1-base) port=$TG_1_BASE;; *) continue;;
    esac
    for c in 1 32 256; do
      out=$(taskset -c 0 wrk -t1 -c$c -d"${SECS}s" --latency -H 'X-Api-Key: bench-key' "http://127.0.0.1:$port/v1/orders")
      rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
      p50=$(echo "$out" | awk '$1 == "50%" {print $2}'); p99=$(echo "$out" | awk '$1 == "99%" {print $2}')
      echo "| $t | $c | $rps | $p50 | $p99 |"
    done
  done
fi
# The decision service on every core: --threads 2, unpinned, wrk POSTing decisions.
cat > "$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["X-Original-URI"] = "/v1/orders"
wrk.headers["X-Forwarded-For"] = "203.0.113.7"
LUA
$TG run --policy "$WORK/one.json" --admin-listen 127.0.0.1:18930 --threads 2 2>/dev/null &
PID_DEC2=$!; PIDS+=("$PID_DEC2"); sleep 1.5
before=$(cpu_ticks $PID_DEC2)
out=$(wrk -t2 -c64 -d"${SECS}s" -s "$WORK/post.lua" http://127.0.0.1:18930/v1/decision)
after=$(cpu_ticks $PID_DEC2)
rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
total=$(echo "$out" | awk '/requests in/ {print $1}')
awk -v d=$((after - before)) -v n="$total" -v k="$TICK_US" -v s="$SECS" -v r="$rps" 'BEGIN {
  cpu = d * k / 1e6; printf "\ndecision service, --threads 2 (wrk on the same 2 cores): %s decisions/s, %.2f cores busy, %.0f decisions per CPU-second, %.1f µs CPU per decision\n", r, cpu / s, n / cpu, cpu * 1e6 / n }'
# Health while decisions saturate the workers.
wrk -t2 -c64 -d3s -s "$WORK/post.lua" http://127.0.0.1:18930/v1/decision >/dev/null &
sleep 1
curl -s -o /dev/null -w 'GET /livez during the flood: %{http_code} in %{time_total} s\n' http://127.0.0.1:18930/livez
curl -s -o /dev/null -w 'GET /metrics during the flood: %{http_code} in %{time_total} s\n' http://127.0.0.1:18930/metrics
wait %% 2>/dev/null || true
