#!/usr/bin/env bash
# Builds tollgate's container image here, without a registry, and checks it as a container
# runtime would run it (scripts/test.sh runs this):
#   1. a Debian bookworm root from debootstrap (cached in target/image-cache/, or in
#      $TOLLGATE_IMAGE_CACHE), cut down to a distroless-like base (glibc, libgcc, CA
#      certificates, passwd/group with nonroot = 65532; no shell, no package manager) and
#      imported as localhost/tollgate-base:bookworm;
#   2. the shipped binary (scripts/shipped-build.sh: the release build optimised with the
#      committed profile; or TOLLGATE_BINARY=path), stripped, in an image of its own,
#      localhost/tollgate-binary:local;
#   3. the Dockerfile's runtime built from those two (`podman build --target runtime-prebuilt`,
#      the default target's runtime with the binary taken from that image);
#   4. the image's filesystem exported and its ENTRYPOINT/CMD started with its ENV, USER and
#      WORKDIR in a chroot, in a network namespace of its own (with an upstream there, named by
#      TOLLGATE_UPSTREAM as `docker run -e` would), with the VOLUME as a bind mount: /livez and
#      /readyz answer, the proxy forwards, the shipped policy refuses the 21st decision for one
#      client (429), the process has neither uid 0 nor a capability, the state dir is written
#      by that user, a second container (a fresh export) on the same volume finds the buckets,
#      and SIGTERM with a request in flight lets it finish, then exits 0.
#   5. what it measured (the image's size, its base's, how long the run took without the
#      shipped build) written into the manual, between the image-facts markers of
#      docs/src/operations/deploying.md: the page shows measured figures, never typed ones
#      (not with TOLLGATE_BINARY: the page's image is the shipped build's).
# Any failure stops it with "image.sh: FAILED: ..." and exit 1; nothing is skipped.
#
# `bash scripts/image.sh --write-facts PAGE IMAGE_BYTES BASE_BYTES SECONDS first|later` does
# step 5 alone on PAGE (tests/deploy.rs checks it so).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "image.sh: FAILED: $*" >&2
  exit 1
}
say() { echo "image.sh: $*" >&2; }

FACTS_PAGE=docs/src/operations/deploying.md
# Rewrites the lines between `<!-- image-facts -->` and `<!-- /image-facts -->` of PAGE with the
# figures of this run. A first run (debootstrap made the base) and a later one (the base cached)
# each have their own row; the row this run did not measure keeps its last value.
write_facts() {
  python3 - "$@" <<'EOF' || fail "cannot write the image figures into $1"
import re, sys
page, image_bytes, base_bytes, seconds, run, cores, day = sys.argv[1:8]
if run not in ("first", "later"):
    sys.exit(f"the run is 'first' or 'later', not {run!r}")
text = open(page).read()
begin, end = "<!-- image-facts -->\n", "<!-- /image-facts -->"
start = text.find(begin)
stop = text.find(end, start + 1) if start >= 0 else -1
if start < 0 or stop < 0 or text.count(begin) != 1:
    sys.exit(f"{page}: no single block between {begin.strip()} and {end}")
rows = {}
for line in text[start + len(begin):stop].splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 2:
        rows[cells[0]] = cells[1]
mib = lambda n: f"{int(n) // 1048576} MiB"  # as the run's own messages round
first, later = "a first run (`debootstrap` builds the base)", "a later run (the base cached)"
rows["the image"] = f"{mib(image_bytes)} ({int(image_bytes):,} bytes)".replace(",", " ")
rows["its base (glibc, libgcc, CA certificates)"] = mib(base_bytes)
rows[first if run == "first" else later] = f"{seconds} s, measured {day} on {cores} cores"
body = "| measured by `scripts/image.sh` | |\n|---|---|\n"
for key in ("the image", "its base (glibc, libgcc, CA certificates)", first, later):
    body += f"| {key} | {rows.get(key, 'not measured yet')} |\n"
open(page, "w").write(text[:start + len(begin)] + body + text[stop:])
EOF
}
if [ "${1:-}" = --write-facts ]; then
  [ $# -eq 6 ] || fail "usage: image.sh --write-facts PAGE IMAGE_BYTES BASE_BYTES SECONDS first|later"
  write_facts "$2" "$3" "$4" "$5" "$6" "$(nproc)" "$(date -u +%Y-%m-%d)"
  exit 0
fi

started=$(date +%s)
build_secs=0
first_run=later
[ "$(id -u)" -eq 0 ] || fail "needs root (debootstrap, podman, chroot, network namespaces)"
for tool in podman debootstrap setpriv unshare ip curl strip python3 tar; do
  command -v "$tool" >/dev/null 2>&1 || fail "$tool is not installed (bash scripts/install-deps.sh installs it)"
done

CACHE=${TOLLGATE_IMAGE_CACHE:-target/image-cache}
SUITE=bookworm
ARCH=$(dpkg --print-architecture)
BASE_IMAGE=localhost/tollgate-base:$SUITE
BINARY_IMAGE=localhost/tollgate-binary:local
IMAGE=${TOLLGATE_IMAGE:-localhost/tollgate:local}
# Marks the images this script makes, so the ones a rebuild leaves untagged can be pruned.
LABEL=org.tollgate.image-sh=1
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)

# --- 1. the base ----------------------------------------------------------------------------
DEBOOTSTRAP_ROOT=$CACHE/debootstrap-$SUITE
if [ ! -e "$DEBOOTSTRAP_ROOT/.complete" ]; then
  first_run=first
  say "debootstrap $SUITE into $DEBOOTSTRAP_ROOT (once; cached)"
  rm -rf "$DEBOOTSTRAP_ROOT.partial"
  debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$DEBOOTSTRAP_ROOT.partial" \
    "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$CACHE/debootstrap.log" 2>&1 \
    || fail "debootstrap $SUITE failed (see $CACHE/debootstrap.log)"
  rm -rf "$DEBOOTSTRAP_ROOT"
  mv "$DEBOOTSTRAP_ROOT.partial" "$DEBOOTSTRAP_ROOT"
  touch "$DEBOOTSTRAP_ROOT/.complete"
fi

# The runtime base: only what a dynamically linked Rust binary and TLS to upstreams need.
BASE_ROOT=$CACHE/base-rootfs
rm -rf "$BASE_ROOT"
mkdir -p "$BASE_ROOT"/{usr/lib,usr/lib64,etc/ssl/certs,tmp,var/lib,proc,sys,dev,run}
chmod 1777 "$BASE_ROOT/tmp"
for link in bin lib lib64 sbin; do
  if [ -L "$DEBOOTSTRAP_ROOT/$link" ]; then cp -a "$DEBOOTSTRAP_ROOT/$link" "$BASE_ROOT/$link"; fi
done
for pkg in libc6 libgcc-s1; do
  list=$DEBOOTSTRAP_ROOT/var/lib/dpkg/info/$pkg:$ARCH.list
  [ -f "$list" ] || fail "no file list for $pkg in the debootstrap root ($list)"
  # Shared objects only: no gconv modules, programs, locales or docs.
  grep -E '^/(usr/)?lib[^/]*/.*\.so(\.[0-9.]+)?$' "$list" | grep -v '/gconv/' \
    | while read -r file; do (cd "$DEBOOTSTRAP_ROOT" && cp -a --parents ".$file" "$BASE_ROOT"); done \
    || fail "copying $pkg's shared objects out of the debootstrap root failed"
  mkdir -p "$BASE_ROOT/usr/share/doc/$pkg"
  cp "$DEBOOTSTRAP_ROOT/usr/share/doc/$pkg/copyright" "$BASE_ROOT/usr/share/doc/$pkg/"
done
mkdir -p "$BASE_ROOT/usr/share/doc/ca-certificates"
cp "$DEBOOTSTRAP_ROOT/usr/share/doc/ca-certificates/copyright" "$BASE_ROOT/usr/share/doc/ca-certificates/"
cp -L "$DEBOOTSTRAP_ROOT/etc/ssl/certs/ca-certificates.crt" "$BASE_ROOT/etc/ssl/certs/"
cp -L "$DEBOOTSTRAP_ROOT/etc/os-release" "$BASE_ROOT/etc/os-release"
cat >"$BASE_ROOT/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin
EOF
cat >"$BASE_ROOT/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
nonroot:x:65532:
EOF
printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$BASE_ROOT/etc/nsswitch.conf"
printf '127.0.0.1 localhost\n::1 localhost\n' >"$BASE_ROOT/etc/hosts"
tar --numeric-owner --sort=name --mtime=@0 -C "$BASE_ROOT" -cf "$CACHE/base.tar" .
podman import --quiet --change "LABEL $LABEL" "$CACHE/base.tar" "$BASE_IMAGE" >/dev/null \
  || fail "podman import of the base failed"

# --- 2. the binary --------------------------------------------------------------------------
BINARY=${TOLLGATE_BINARY:-}
if [ -z "$BINARY" ]; then
  # The shipped build, which CI's instruction gate and fair harness measure too: whichever
  # runs first builds it, the others find it up to date.
  build_started=$(date +%s)
  bash scripts/shipped-build.sh || fail "scripts/shipped-build.sh failed"
  build_secs=$(($(date +%s) - build_started))
  BINARY=target/shipped/release/tollgate
fi
[ -x "$BINARY" ] || fail "no binary at $BINARY"
BINARY_CONTEXT=$CACHE/binary-context
rm -rf "$BINARY_CONTEXT"
mkdir -p "$BINARY_CONTEXT/state"
strip -o "$BINARY_CONTEXT/tollgate" "$BINARY"
printf 'FROM scratch\nCOPY tollgate /out/tollgate\nCOPY state /out/state\n' >"$BINARY_CONTEXT/Containerfile"
podman build --quiet --pull=never --label "$LABEL" -f "$BINARY_CONTEXT/Containerfile" -t "$BINARY_IMAGE" \
  "$BINARY_CONTEXT" >/dev/null || fail "podman build of the binary image failed"

# --- 3. the runtime of the Dockerfile -------------------------------------------------
podman build --quiet --pull=never --label "$LABEL" --target runtime-prebuilt \
  --build-arg RUNTIME_BASE="$BASE_IMAGE" --build-arg BINARY_IMAGE="$BINARY_IMAGE" \
  -t "$IMAGE" . >/dev/null || fail "podman build --target runtime-prebuilt of the Dockerfile failed"
podman image prune --force --filter "label=$LABEL" >/dev/null
size_bytes=$(podman image inspect "$IMAGE" --format '{{.Size}}')
say "built $IMAGE: $((size_bytes / 1024 / 1024)) MiB ($size_bytes bytes; base $(($(stat -c %s "$CACHE/base.tar") / 1024 / 1024)) MiB)"

# --- 4. run it as a runtime would -----------------------------------------------------------
# The image's configuration, one value per line: ENTRYPOINT and CMD words (NUL-separated),
# ENV entries, USER, WORKDIR, volumes.
podman image inspect "$IMAGE" --format '{{json .Config}}' >"$CACHE/config.json"
config() { python3 - "$CACHE/config.json" "$1" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
what = sys.argv[2]
if what == "argv":
    words = (config.get("Entrypoint") or []) + (config.get("Cmd") or [])
    sys.stdout.write("\0".join(words) + "\0")
elif what == "env":
    sys.stdout.write("\0".join(config.get("Env") or []) + "\0")
elif what == "volumes":
    print("\n".join(sorted(config.get("Volumes") or {})))
else:
    print(config.get(what) or "")
EOF
}
mapfile -d '' -t ARGV < <(config argv)
mapfile -d '' -t ENVS < <(config env)
USER_SPEC=$(config User)
WORKDIR=$(config WorkingDir)
VOLUME=$(config volumes)
[ ${#ARGV[@]} -gt 0 ] || fail "the image has no ENTRYPOINT/CMD"
[ -n "$USER_SPEC" ] || fail "the image has no USER: it would run as root"
[ -n "$WORKDIR" ] || WORKDIR=/
[ "$(printf '%s\n' "$VOLUME" | grep -c .)" -eq 1 ] || fail "expected one VOLUME, the image has: $VOLUME"
state_dir=""
for ((i = 0; i + 1 < ${#ARGV[@]}; i++)); do
  if [ "${ARGV[i]}" = --state-dir ]; then state_dir=${ARGV[i + 1]}; fi
done
[ "$state_dir" = "$VOLUME" ] || fail "ENTRYPOINT/CMD's --state-dir ($state_dir) is not the image's VOLUME ($VOLUME)"

RUN=$CACHE/run
NS=tollgate-image-$$
pid=""
upstream_pid=""
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  if [ -n "$upstream_pid" ]; then kill "$upstream_pid" 2>/dev/null || true; fi
  for root in "$RUN"/rootfs-*; do
    if [ -n "$VOLUME" ] && mountpoint -q "$root$VOLUME" 2>/dev/null; then umount "$root$VOLUME" || true; fi
  done
  ip netns del "$NS" 2>/dev/null || true
}
trap cleanup EXIT
for root in "$RUN"/rootfs-*; do
  if [ -d "$root" ] && mountpoint -q "$root$VOLUME" 2>/dev/null; then umount "$root$VOLUME"; fi
done
rm -rf "$RUN"
mkdir -p "$RUN/volume"
ip netns add "$NS" || fail "cannot make a network namespace"
ip -n "$NS" link set lo up

# An upstream API in the namespace, on the host's python: `/slow` answers after 0.6 s.
cat >"$RUN/upstream.py" <<'EOF'
import http.server, time
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow":
            time.sleep(0.6)
        body = b"upstream ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 3000), Handler).serve_forever()
EOF
ip netns exec "$NS" python3 "$RUN/upstream.py" &
upstream_pid=$!
# The one setting a deployment adds to the image's (as `docker run -e` would): the upstream.
RUN_ENVS=("${ENVS[@]}" TOLLGATE_UPSTREAM=127.0.0.1:3000)

# A fresh container: the image's filesystem exported, the volume mounted where VOLUME says,
# seeded from the image (owner and mode) the first time, as a runtime's named volume is.
export_rootfs() {
  local root=$1 id
  mkdir -p "$root"
  id=$(podman create --pull=never "$IMAGE") || fail "podman create failed"
  podman export "$id" | tar --numeric-owner -x -C "$root" || fail "podman export failed"
  podman rm "$id" >/dev/null
  if [ ! -e "$RUN/volume-seeded" ]; then
    chown --reference="$root$VOLUME" "$RUN/volume"
    chmod --reference="$root$VOLUME" "$RUN/volume"
    touch "$RUN/volume-seeded"
  fi
  mount --bind "$RUN/volume" "$root$VOLUME" || fail "cannot bind-mount the volume"
}

# The user the image names, numeric or by name in its /etc/passwd.
resolve_user() {
  local root=$1 user=${USER_SPEC%%:*} group=${USER_SPEC#*:}
  [ "$group" = "$USER_SPEC" ] && group=""
  if ! [[ $user =~ ^[0-9]+$ ]]; then
    user=$(awk -F: -v u="$user" '$1 == u { print $3 }' "$root/etc/passwd")
  fi
  if [ -z "$group" ]; then
    group=$(awk -F: -v u="$user" '$3 == u { print $4 }' "$root/etc/passwd")
  elif ! [[ $group =~ ^[0-9]+$ ]]; then
    group=$(awk -F: -v g="$group" '$1 == g { print $3 }' "$root/etc/group")
  fi
  [ -n "$user" ] && [ -n "$group" ] || fail "USER $USER_SPEC does not resolve in the image"
  echo "$user $group"
}

in_ns() { ip netns exec "$NS" "$@"; }
http_code() { in_ns curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$@" || true; }

# ENTRYPOINT + CMD with the image's ENV (and the upstream) only, chrooted into the export at WORKDIR as USER (no
# supplementary groups, no new privileges), in the network namespace; $pid is the gateway.
start_container() {
  local root=$1 log=$2 ids
  ids=$(resolve_user "$root")
  uid=${ids% *}
  gid=${ids#* }
  [ "$uid" -ne 0 ] || fail "the image's USER is root"
  ip netns exec "$NS" env -i "${RUN_ENVS[@]}" \
    "$(command -v setpriv)" --no-new-privs --inh-caps=-all \
    "$(command -v unshare)" --root="$root" --wd="$WORKDIR" --setgid="$gid" --setuid="$uid" \
    -- "${ARGV[@]}" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do
    if [ "$(http_code http://127.0.0.1:9090/livez)" = 200 ] \
      && [ "$(in_ns curl -s --max-time 5 http://127.0.0.1:8080/ || true)" = "upstream ok" ]; then
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || fail "the gateway exited at start-up:
$(cat "$log")"
    sleep 0.1
  done
  fail "/livez and the proxy did not answer within 10 s:
$(cat "$log")"
}

# SIGTERM while a request is in flight (the upstream takes 0.6 s; tollgate gives requests in
# flight 1 s after SIGTERM): it is answered, then the gateway exits 0.
stop_container() {
  local log=$1 status=0 in_flight
  in_ns curl -s -o /dev/null -w '%{http_code}' --max-time 15 http://127.0.0.1:8080/slow >"$RUN/in-flight" &
  in_flight=$!
  sleep 0.2
  kill -TERM "$pid"
  wait "$pid" || status=$?
  pid=""
  wait "$in_flight" || true
  [ "$(cat "$RUN/in-flight")" = 200 ] || fail "SIGTERM: the request in flight got '$(cat "$RUN/in-flight")', not 200"
  [ "$status" -eq 0 ] || fail "SIGTERM: the gateway exited $status, not 0:
$(cat "$log")"
  grep -q 'SIGTERM: draining' "$log" || fail "SIGTERM: no 'SIGTERM: draining' in the log"
  grep -q 'tollgate stopped' "$log" || fail "SIGTERM: no 'tollgate stopped' in the log"
  [ "$(http_code http://127.0.0.1:9090/livez)" = 000 ] || fail "SIGTERM: the admin listener still answers"
}

# Nothing to run a shell or install a package with.
export_rootfs "$RUN/rootfs-1"
for path in bin/sh bin/bash usr/bin/sh usr/bin/bash bin/busybox usr/bin/apt usr/bin/apt-get usr/bin/dpkg; do
  [ ! -e "$RUN/rootfs-1/$path" ] || fail "the image has /$path (no shell or package manager at run time)"
done

start_container "$RUN/rootfs-1" "$RUN/gateway-1.log"
[ "$(http_code http://127.0.0.1:9090/readyz)" = 200 ] || fail "/readyz did not answer 200:
$(cat "$RUN/gateway-1.log")"

# Who the process is: not root, no capability, no supplementary group.
status=/proc/$pid/status
[ "$(cat "/proc/$pid/comm")" = tollgate ] || fail "pid $pid is $(cat "/proc/$pid/comm"), not tollgate"
read -r _ ruid euid suid fsuid < <(grep '^Uid:' "$status")
[ "$ruid $euid $suid $fsuid" = "$uid $uid $uid $uid" ] || fail "the gateway runs with uids $ruid $euid $suid $fsuid, not $uid"
read -r _ rgid egid _ _ < <(grep '^Gid:' "$status")
[ "$rgid $egid" = "$gid $gid" ] || fail "the gateway runs with gids $rgid $egid, not $gid"
[ -z "$(grep '^Groups:' "$status" | cut -f2 | tr -d ' ')" ] || fail "the gateway has supplementary groups: $(grep '^Groups:' "$status")"
for cap in CapEff CapPrm CapAmb; do
  [ "$(awk -v c="$cap:" '$1 == c { print $2 }' "$status")" = 0000000000000000 ] || fail "the gateway holds capabilities ($(grep "^$cap" "$status"))"
done
[ "$(awk '$1 == "NoNewPrivs:" { print $2 }' "$status")" = 1 ] || fail "no_new_privs is not set"
[ "$(readlink "/proc/$pid/cwd")" = "$(cd "$RUN/rootfs-1$WORKDIR" && pwd -P)" ] || fail "the gateway's working directory is not WORKDIR $WORKDIR"

# The shipped policy (per-ip: burst 20, 10 a second): 20 decisions for one client pass, the
# 21st is refused. One connection, so the burst takes milliseconds and nothing refills.
urls=()
for _ in $(seq 21); do urls+=(-o /dev/null http://127.0.0.1:9090/v1/decision); done
codes=$(in_ns curl -s -X POST -H 'X-Forwarded-For: 203.0.113.7' -w '%{http_code} ' "${urls[@]}")
expected="$(printf '200 %.0s' $(seq 20))429 "
[ "$codes" = "$expected" ] || fail "the shipped policy: expected 20 × 200 then 429, got: $codes"

# The state dir is the volume, written by the gateway's user.
for file in buckets.state owner.lock; do
  [ -f "$RUN/volume/$file" ] || fail "the state dir (volume) has no $file"
  [ "$(stat -c %u "$RUN/volume/$file")" = "$uid" ] || fail "$file in the volume is not owned by uid $uid"
done
grep -q 'kept in its files.*created=true' "$RUN/gateway-1.log" || fail "the first container did not make its state file:
$(cat "$RUN/gateway-1.log")"
stop_container "$RUN/gateway-1.log"
umount "$RUN/rootfs-1$VOLUME"

# A second container from a fresh export on the same volume continues the buckets: two clients'
# (203.0.113.7's decisions, and 127.0.0.1's proxied requests).
export_rootfs "$RUN/rootfs-2"
start_container "$RUN/rootfs-2" "$RUN/gateway-2.log"
grep -q 'kept in its files.*entries=2 created=false' "$RUN/gateway-2.log" || fail "the restarted container did not find the bucket in the volume:
$(cat "$RUN/gateway-2.log")"
entries=$(in_ns curl -s http://127.0.0.1:9090/metrics | awk '$1 == "tollgate_store_entries" { print $2 }')
[ "$entries" = 2 ] || fail "after the restart tollgate_store_entries is '$entries', not 2"
[ -z "$(find "$RUN/volume" -name 'buckets.state.bad-*')" ] || fail "the restart moved the state file aside"
stop_container "$RUN/gateway-2.log"

say "checked: ENTRYPOINT [${ARGV[*]}] as uid $uid gid $gid in $WORKDIR (no capabilities, no shell in the image); /livez, /readyz, proxied; 20 × 200 then 429; state in VOLUME $VOLUME kept across a new container; SIGTERM answered the request in flight, exit 0"
run_secs=$(($(date +%s) - started - build_secs))
say "image $IMAGE: $((size_bytes / 1024 / 1024)) MiB; done in $run_secs s ($first_run run; the shipped build's $build_secs s not counted)"
# The page's figures are the shipped build's image: another binary's are not written there.
if [ -n "${TOLLGATE_BINARY:-}" ]; then
  say "figures not written into $FACTS_PAGE (TOLLGATE_BINARY: not the shipped build)"
else
  write_facts "$FACTS_PAGE" "$size_bytes" "$(stat -c %s "$CACHE/base.tar")" "$run_secs" "$first_run" "$(nproc)" "$(date -u +%Y-%m-%d)"
  say "figures written into $FACTS_PAGE (its image-facts block)"
fi
