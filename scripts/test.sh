#!/usr/bin/env bash
# The whole test suite: installs what the tests need, then runs every unit, property,
# integration and CLI test (benches are compiled and run once in test mode).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo test --all-targets "$@"
