#!/usr/bin/env bash
# The fair harness, short, for CI's record (never its verdict): tollgate's CPU per request over
# bare Pingora's, allowed (one rule, against the bare proxy) and refused (every request refused,
# against the bare proxy answering the same 429). Runs benches/load.sh on the shipped build
# (scripts/shipped-build.sh: both proxies built together from the committed profile; 3 rounds
# of 3 s: bare, bare-429, tg-1, tg-429; about a minute once built) and prints the two ratios
# with their medians. Always exits 0: when the harness cannot run, it says why.
#
# Usage: bash benches/ratios.sh [OUT]   (OUT: a file that also receives the figures)
cd "$(dirname "$0")/.." || exit 0
OUT=${1:-/dev/null}
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
if ! command -v taskset >/dev/null || [ "$(nproc)" -lt 2 ]; then
  echo "fair harness: not run (needs taskset and 2 cores)" | tee "$OUT"
  exit 0
fi
if ! TARGETS="bare bare-429 tg-1 tg-429" PROFILE=shipped timeout 170 \
  bash benches/load.sh 3 3 32 >"$LOG" 2>&1; then
  echo "fair harness: did not finish (exit or timeout); its last lines:" | tee "$OUT"
  tail -5 "$LOG" | tee -a "$OUT"
  exit 0
fi
median() { awk -F'|' -v name="$1" '$2 ~ name { gsub(/ /, "", $4); print $4; exit }' "$LOG"; }
bare=$(median "bare Pingora proxy, same build"); bare429=$(median "bare Pingora, every request refused")
tg1=$(median "tollgate, 1 per-IP rule"); tg429=$(median "tollgate, every request refused")
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }
{
  printf 'fair harness (shipped build: release, profile-guided; 3 rounds of 3 s, medians of proxy CPU µs per request):\n'
  printf '  allowed, 1 rule: tollgate %s / bare Pingora %s = %s× bare Pingora\n' "$tg1" "$bare" "$(ratio "$tg1" "$bare")"
  printf '  refused (429):   tollgate %s / bare Pingora %s = %s× bare Pingora\n' "$tg429" "$bare429" "$(ratio "$tg429" "$bare429")"
} | tee "$OUT"
exit 0
