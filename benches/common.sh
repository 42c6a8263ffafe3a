# Shared by the fair harnesses (benches/load.sh, benches/edge.sh); sourced, not run. Sets up
# a work directory removed on exit with every process in PIDS (and every nginx pid file in it),
# and defines nginx_conf, cpu_ticks, TICK_US and median.
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
