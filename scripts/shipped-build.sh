#!/usr/bin/env bash
# The build tollgate ships: the release profile, optimised with the profile-guided data committed
# in pgo/profile.profdata.xz (written by `scripts/pgo-build.sh --write` from the load harness's
# own traffic). Builds tollgate and the load harness's bare Pingora proxy together, from the same
# profile, so every comparison between them stays like for like:
#   target/shipped/release/tollgate
#   target/shipped/release/examples/bare_proxy
# scripts/image.sh puts the first in the image; CI's instruction gate (benches/instructions.sh
# --check) and its fair harness ratios (benches/ratios.sh) measure both.
#
# Usage: bash scripts/shipped-build.sh
#
# Needs: xz (Debian's xz-utils) and the rustc that wrote the profile (pgo/rustc-version). Cargo
# gives every crate another hash under another compiler, and the profile finds functions by
# their symbols, which carry it: with another rustc no function finds its counts, and the build
# is a plain release build's code (the script says so). A function changed since the profile was
# written is built without its counts too; the instruction gate shows when enough has drifted
# to write it again. RUSTFLAGS is not read: the build's flags are the profile's.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMITTED=pgo/profile.profdata.xz
[ -f "$COMMITTED" ] || { echo "shipped-build: $COMMITTED is missing" >&2; exit 1; }
command -v xz >/dev/null || { echo "shipped-build: needs xz (apt-get install xz-utils)" >&2; exit 1; }
wrote=$(cat pgo/rustc-version 2>/dev/null || echo "an unrecorded rustc")
running=$("${RUSTC:-rustc}" -V)
if [ "$running" != "$wrote" ]; then
  echo "shipped-build: the profile was written by $wrote and this is $running: under another" >&2
  echo "shipped-build: compiler no function finds its counts, so this build is a plain release" >&2
  echo "shipped-build: build's code. Build with $wrote, or write the profile again" >&2
  echo "shipped-build: (bash scripts/pgo-build.sh --write)." >&2
fi
# Unpacked under a name taken from its content: a new profile is a new path, so cargo rebuilds
# from it (it does not look inside the file); the same one is reused as it is.
dir=$PWD/target/shipped-profile
sum=$(sha256sum "$COMMITTED" | cut -c1-16)
profile=$dir/$sum.profdata
if [ ! -f "$profile" ]; then
  mkdir -p "$dir"
  find "$dir" -name '*.profdata' -delete
  partial=$(mktemp "$dir/unpacking.XXXXXX")
  xz -dc "$COMMITTED" > "$partial"
  mv "$partial" "$profile"
fi
# Both targets in every build: a crate's private symbols carry its hash, which changes with the
# features a build unifies, and the profile names functions by symbol (scripts/pgo-build.sh).
# Mismatch warnings are off: a function edited since the profile was written simply has none.
# (Encoded: one flag per field, so a path with a space in it stays one flag.)
CARGO_TARGET_DIR=$PWD/target/shipped \
  CARGO_ENCODED_RUSTFLAGS="-Cprofile-use=$profile"$'\x1f'"-Cllvm-args=-no-pgo-warn-mismatch" \
  cargo build --release --locked --quiet --bin tollgate --example bare_proxy
