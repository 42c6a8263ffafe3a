# Shared by the fair harnesses (benches/load.sh, benches/edge.sh); sourced, not run. Sets up
# a work directory removed on exit with every process in PIDS (and every nginx pid file in it),
# and defines nginx_conf, bench_policies, cpu_ticks, TICK_US and median. (scripts/pgo-build.sh
# sources it too: its training traffic is the harness's.)
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for f in "$WORK"/*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
  sleep 0.5; rm -rf "$WORK"
}
trap cleanup EXIT
USER_LINE=""; [ "$(id -u)" = 0 ] && USER_LINE="user root;"

nginx_conf() { # name, body: $WORK/<name>.conf, one worker, no access log
  cat > "$WORK/$1.conf" <<NGINX
$USER_LINE
worker_processes 1;
pid $WORK/$1.pid;
error_log $WORK/$1.error.log error;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/$1-cb; proxy_temp_path $WORK/$1-px; fastcgi_temp_path $WORK/$1-fc;
  uwsgi_temp_path $WORK/$1-uw; scgi_temp_path $WORK/$1-sc;
  $2
}
NGINX
}

# CPU ticks (user + system, every thread) of the given processes, and µs per tick.
cpu_ticks() { local t=0; for p in "$@"; do t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat"))); done; echo $t; }
TICK_US=$((1000000 / $(getconf CLK_TCK)))

# The median of the numbers on standard input (space-separated).
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# The harness's policies, written into $WORK: one.json (one per-IP rule that never refuses),
# deny.json (one that refuses every request) and five.json (IP, key, key+path and global rules
# that never refuse, and a shadow one).
bench_policies() {
  rule() { # name, keys, rps, burst
    printf '{"name": "%s", "limit_keys": %s, "algorithm": "token_bucket", "on_missing": "shared", "algorithm_config": {"rps": %s, "burst": %s}}' "$1" "$2" "$3" "$4"
  }
  echo "{\"rules\": [$(rule per-ip '["ip:address"]' 1000000000 1000000000)]}" > "$WORK/one.json"
  echo "{\"rules\": [$(rule deny '["ip:address"]' 0.000001 1)]}" > "$WORK/deny.json"
  cat > "$WORK/five.json" <<JSON
{"bundle_version": 1, "policies": [
  {"id": "a", "spec": {"rules": [
    $(rule per-ip '["ip:address"]' 1000000000 1000000000),
    $(rule per-key '["header:x-api-key"]' 1000000000 1000000000),
    $(rule per-key-path '["header:x-api-key", "path"]' 1000000000 1000000000),
    $(rule global '[]' 1000000000 1000000000)]}},
  {"id": "s", "spec": {"mode": "shadow", "rules": [$(rule shadow-ip '["ip:address"]' 1000000000 1000000000)]}}]}
JSON
}
