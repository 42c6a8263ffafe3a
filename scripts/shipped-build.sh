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
# Needs: xz (Debian's xz-utils) and rustc 1.85 or later (LLVM 19 or later reads the profile).
# A function changed since the profile was written is built without its counts (as a plain
# release build would); the instruction gate shows when enough has drifted to write it again.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMITTED=pgo/profile.profdata.xz
[ -f "$COMMITTED" ] || { echo "shipped-build: $COMMITTED is missing" >&2; exit 1; }
command -v xz >/dev/null || { echo "shipped-build: needs xz (apt-get install xz-utils)" >&2; exit 1; }
# Unpacked under a name taken from its content: a new profile is a new path, so cargo rebuilds
# from it (it does not look inside the file); the same one is reused as it is.
dir=$PWD/target/shipped-profile
sum=$(sha256sum "$COMMITTED" | cut -c1-16)
profile=$dir/$sum.profdata
if [ ! -f "$profile" ]; then
  mkdir -p "$dir"
  find "$dir" -name '*.profdata' -delete
  xz -dc "$COMMITTED" > "$profile.partial"
  mv "$profile.partial" "$profile"
fi
# Both targets in every build: a crate's private symbols carry its hash, which changes with the
# features a build unifies, and the profile names functions by symbol (scripts/pgo-build.sh).
# Mismatch warnings are off: a function edited since the profile was written simply has none.
CARGO_TARGET_DIR=$PWD/target/shipped \
  RUSTFLAGS="-Cprofile-use=$profile -Cllvm-args=-no-pgo-warn-mismatch" \
  cargo build --release --locked --quiet --bin tollgate --example bare_proxy
