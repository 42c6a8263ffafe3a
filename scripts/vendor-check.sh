#!/usr/bin/env bash
# Checks that each crate carried under vendor/ is its crates.io release plus exactly the patches
# vendor/README.md lists for it, applied in file-name order, and nothing else.
#
#   bash scripts/vendor-check.sh --fetch   downloads each release's .crate into
#                                          target/vendor-releases/ (once; scripts/test.sh runs it)
#   bash scripts/vendor-check.sh [VENDOR]  the check itself, offline, against the downloaded
#                                          .crate files (VENDOR defaults to vendor/)
#
# The releases, versions and .crate sha256 sums are read from vendor/README.md's table; a
# download whose sum differs is refused. The check fails when a patch file is not listed or a
# listed one is missing, when a patch does not apply cleanly, or when any file differs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="$root/target/vendor-releases"
fetch=false
vendor="$root/vendor"
case "${1:-}" in
  --fetch) fetch=true ;;
  "") ;;
  *) vendor="$(cd "$1" && pwd)" ;;
esac
readme="$root/vendor/README.md"

# `| `pingora-core/` | 0.9.1 | `sha256` |` rows of the release table.
releases=$(sed -n 's/^| `\([a-z0-9_-]*\)\/` | \([0-9][0-9.]*\) | `\([0-9a-f]\{64\}\)` |$/\1 \2 \3/p' "$readme")
[ -n "$releases" ] || { echo "vendor-check: no release rows in $readme" >&2; exit 1; }

failed=0
while read -r crate version sum; do
  file="$cache/$crate-$version.crate"
  if $fetch; then
    if [ ! -f "$file" ] || ! echo "$sum  $file" | sha256sum -c --status; then
      mkdir -p "$cache"
      curl -fsSL --retry 3 -o "$file.part" "https://static.crates.io/crates/$crate/$crate-$version.crate"
      echo "$sum  $file.part" | sha256sum -c --status || {
        echo "vendor-check: $crate $version from crates.io does not have the sha256 vendor/README.md gives" >&2
        rm -f "$file.part"; exit 1; }
      mv "$file.part" "$file"
    fi
    continue
  fi
  [ -f "$file" ] || { echo "vendor-check: $file is missing: run bash scripts/vendor-check.sh --fetch" >&2; exit 1; }
  echo "$sum  $file" | sha256sum -c --status || { echo "vendor-check: $file does not have the listed sha256" >&2; exit 1; }

  # The patches listed for this crate, and the ones on disk: the same set.
  listed=$(grep -o "patches/$crate/[^\`]*\.patch" "$readme" | sort -u)
  on_disk=$(ls "$root/vendor/patches/$crate/"*.patch 2>/dev/null | sed "s|^$root/vendor/||" | sort -u)
  if [ "$listed" != "$on_disk" ]; then
    echo "vendor-check: $crate: the patches in vendor/patches/$crate are not the ones vendor/README.md lists" >&2
    diff <(echo "$listed") <(echo "$on_disk") >&2 || true
    failed=1; continue
  fi

  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  tar -xzf "$file" -C "$work"
  release="$work/$crate-$version"
  for p in $listed; do
    if ! patch -s -p1 -d "$release" --no-backup-if-mismatch < "$root/vendor/$p" >"$work/patch.log" 2>&1; then
      echo "vendor-check: $p does not apply cleanly to $crate $version:" >&2
      cat "$work/patch.log" >&2
      failed=1; continue 2
    fi
  done
  if diff -r "$release" "$vendor/$crate" >"$work/diff" 2>&1; then
    echo "vendor/$crate: $crate $version from crates.io + $(echo "$listed" | wc -l) listed patch(es), nothing else"
  else
    echo "vendor-check: vendor/$crate differs from $crate $version + its listed patches:" >&2
    head -50 "$work/diff" >&2
    failed=1
  fi
  rm -rf "$work"
done <<< "$releases"
$fetch && exit 0
exit $failed
