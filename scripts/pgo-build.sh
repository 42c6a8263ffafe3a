#!/usr/bin/env bash
# Builds tollgate and the load harness's bare Pingora proxy with profile-guided optimisation
# (PGO): an instrumented build of both first, then the request path's own traffic through each
# (what the load harness sends: through tollgate one rule, five rules, every request refused, no
# policy; through the bare proxy proxied requests and its 429; HTTP/1.1 keep-alive from wrk to an
# nginx upstream on loopback), then one optimised build of both from the merged profile. LLVM lays the hot
# code out together and the cold code apart, which is where a request's time goes here: the
# instruction cache (docs/src/performance.md, "Profile-guided builds", has the figures).
#
# Usage: [PROFILE=release|perf] bash scripts/pgo-build.sh [--write]
#   Writes target/pgo/bin/tollgate and target/pgo/bin/bare_proxy: the bare Pingora proxy of
#   the load harness, trained on its own traffic (proxied, and answering 429) and built in the
#   same build from the same merged profile, so a comparison with it stays like for like:
#     TG_BASE=target/pgo/bin/tollgate BARE_BASE=target/pgo/bin/bare_proxy bash benches/load.sh
#   Two builds (instrumented, then optimised), about 5 minutes each on 2 cores (release).
#   --write (release only) also replaces pgo/profile.profdata.xz, the profile the shipped build
#   (scripts/shipped-build.sh) is made from, and builds it; commit the file with a new
#   instruction baseline (bash benches/instructions.sh --write-baseline).
#
# Needs: llvm-profdata of LLVM 19 or later (Debian's llvm-19: it reads and writes the profile
# formats of rustc's LLVM), nginx and wrk; `scripts/install-deps.sh --pgo` installs them when
# missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${PROFILE:-release}
WRITE=false
case "${1:-}" in
  --write) WRITE=true;;
  "") ;;
  *) echo "pgo-build: unknown argument $1 (usage: pgo-build.sh [--write])" >&2; exit 2;;
esac
if $WRITE && [ "$PROFILE" != release ]; then
  echo "pgo-build: --write makes the shipped build's profile, which is a release build's" >&2
  exit 2
fi

bash scripts/install-deps.sh --pgo
profdata=""
for candidate in /usr/lib/llvm-{22,21,20,19}/bin/llvm-profdata; do
  [ -x "$candidate" ] && { profdata=$candidate; break; }
done
[ -n "$profdata" ] || { echo "pgo-build: no llvm-profdata of LLVM 19 or later" >&2; exit 1; }

ROOT=$PWD/target/pgo
RAW=$ROOT/raw
mkdir -p "$ROOT/bin" "$ROOT/profiles"
# Every build names the same targets. A profile matches functions by their symbol names, and
# those of a crate's private functions carry the crate's hash, which changes with the features
# the build unifies: the example brings the dev-dependencies' features in.
build() { # target dir, one rustc flag (encoded: a path with a space in it stays one flag)
  CARGO_TARGET_DIR="$1" CARGO_ENCODED_RUSTFLAGS="$2" cargo build --profile "$PROFILE" --quiet \
    --bin tollgate --example bare_proxy
}

echo "pgo-build: instrumented build ($PROFILE)" >&2
build "$ROOT/gen" "-Cprofile-generate=$RAW"
# The build scripts ran instrumented too: their profiles are not the gateway's.
rm -rf "$RAW"

# A work directory removed on exit (with the upstream nginx), nginx_conf and the harness's own
# policies (one.json, five.json, deny.json).
# shellcheck source=benches/common.sh
source benches/common.sh
UP=28970; LISTEN=28971; ADMIN=28972
nginx_conf upstream "server { listen 127.0.0.1:$UP; keepalive_requests 100000; location / { return 200 \"ok\\n\"; } }"
"$(command -v nginx || echo /usr/sbin/nginx)" -p "$WORK" -c "$WORK/upstream.conf"
bench_policies

# Runs one server under the training traffic, then stops it with SIGTERM: it exits normally,
# and writes its profile on the way out.
train() { # command...
  "$@" >"$WORK/server.log" 2>&1 &
  local pid=$!
  local up=false
  for _ in $(seq 1 100); do
    curl -s -o /dev/null "http://127.0.0.1:$LISTEN/" && { up=true; break; }
    sleep 0.2
  done
  $up || { echo "pgo-build: $1 did not start:" >&2; cat "$WORK/server.log" >&2; exit 1; }
  wrk -t1 -c32 -d4s -H 'X-Api-Key: k' "http://127.0.0.1:$LISTEN/v1/orders" >/dev/null
  wrk -t1 -c4 -d1s "http://127.0.0.1:$LISTEN/v1/items?page=2" >/dev/null
  kill -TERM "$pid"
  wait "$pid" || true
}
TG_GEN="$ROOT/gen/$PROFILE/tollgate"
for policy in one five deny; do
  train "$TG_GEN" run --policy "$WORK/$policy.json" --listen "127.0.0.1:$LISTEN" \
    --upstream "127.0.0.1:$UP" --admin-listen "127.0.0.1:$ADMIN" --threads 1
done
train "$TG_GEN" run --policy "$WORK/missing.json" --wait-for-policy --listen "127.0.0.1:$LISTEN" \
  --upstream "127.0.0.1:$UP" --admin-listen "127.0.0.1:$ADMIN" --threads 1
BARE_GEN="$ROOT/gen/$PROFILE/examples/bare_proxy"
train "$BARE_GEN" "127.0.0.1:$LISTEN" "127.0.0.1:$UP"
train "$BARE_GEN" "127.0.0.1:$LISTEN" "127.0.0.1:$UP" --refuse

# One profile for both binaries: each one's own functions carry only its own runs' counts, and
# the Pingora code they share is optimised from the same counts in both.
merged="$WORK/merged.profdata"
"$profdata" merge -o "$merged" "$RAW"/*.profraw
rm -rf "$RAW"
# Named by its content: a new profile is a new path, so cargo rebuilds from it (it does not
# look inside the file).
PROFILE_FILE="$ROOT/profiles/pgo-$(sha256sum "$merged" | cut -c1-16).profdata"
mv "$merged" "$PROFILE_FILE"
# Earlier runs' profiles are never read again (each build names its own file).
find "$ROOT/profiles" -name '*.profdata' ! -name "$(basename "$PROFILE_FILE")" -delete

if $WRITE; then
  # -T1: the same profile always packs to the same bytes. Written aside, then moved: an
  # interrupted run leaves the committed file as it was. The compiler goes with it (a profile
  # matches only the rustc that wrote it: scripts/shipped-build.sh).
  xz -9 -T1 -c "$PROFILE_FILE" > pgo/profile.profdata.xz.partial
  mv pgo/profile.profdata.xz.partial pgo/profile.profdata.xz
  "${RUSTC:-rustc}" -V > pgo/rustc-version
  echo "pgo-build: wrote pgo/profile.profdata.xz; the shipped build from it" >&2
  bash scripts/shipped-build.sh
  cp target/shipped/release/tollgate "$ROOT/bin/tollgate"
  cp target/shipped/release/examples/bare_proxy "$ROOT/bin/bare_proxy"
else
  echo "pgo-build: optimised build from $(basename "$PROFILE_FILE")" >&2
  build "$ROOT/use" "-Cprofile-use=$PROFILE_FILE"
  cp "$ROOT/use/$PROFILE/tollgate" "$ROOT/bin/tollgate"
  cp "$ROOT/use/$PROFILE/examples/bare_proxy" "$ROOT/bin/bare_proxy"
fi
echo "pgo-build: wrote target/pgo/bin/tollgate and target/pgo/bin/bare_proxy" >&2
