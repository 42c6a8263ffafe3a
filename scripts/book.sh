#!/usr/bin/env bash
# Builds the manual (docs/, an mdBook) into target/book. mdBook itself is installed once from
# crates.io under target/tools (its file watcher, web server and search index left out: only
# `mdbook build` is needed). Links, anchors and every command the manual shows are checked by
# tests/docs.rs; a page missing from docs/src/SUMMARY.md or a file SUMMARY.md names that does
# not exist fails this build (`create-missing = false`).
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.4.52
MDBOOK=target/tools/bin/mdbook
if ! [ -x "$MDBOOK" ] || ! "$MDBOOK" --version | grep -q "v$MDBOOK_VERSION"; then
  cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features \
    --root target/tools --quiet
fi
"$MDBOOK" build docs
echo "book: target/book/index.html"
