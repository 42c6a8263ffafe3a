#!/usr/bin/env bash
# Installs grpcio and grpcio-status (a real gRPC client and server library, and its reader of
# google.rpc error details) into a virtualenv under the build directory (target/grpc-venv),
# never system-wide, and prints that virtualenv's python. Used by scripts/test.sh for the
# gRPC walkthrough (docs/src/getting-started/grpc.md, examples/grpc/echo.py). Needs python3
# with venv (scripts/install-deps.sh installs python3-venv when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TOLLGATE_GRPC_VENV:-target/grpc-venv}
if ! "$VENV/bin/python" -c 'import grpc, grpc_status' 2>/dev/null; then
  echo "install-grpc-python: installing grpcio and grpcio-status into $VENV" >&2
  python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check grpcio grpcio-status >&2
fi
echo "$VENV/bin/python"
