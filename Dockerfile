# tollgate's image: a build stage (the shipped build: release, optimised with the committed
# profile, scripts/shipped-build.sh) and a runtime stage with no shell and no package manager:
# glibc, libgcc and the CA certificates, the binary, the shipped policy.
#
# With a registry (the build stage compiles from source):
#   docker build -t tollgate .            (or: podman build -t tollgate .)
#   docker run -p 8080:8080 -p 127.0.0.1:9090:9090 -v tollgate-state:/var/lib/tollgate \
#       --add-host=host.docker.internal:host-gateway \
#       tollgate --state-dir /var/lib/tollgate --upstream host.docker.internal:3000
# (--add-host: Docker Engine on Linux does not define host.docker.internal, and an --upstream
# that does not resolve stops start-up; the API must then listen on Docker's bridge address or
# 0.0.0.0. The manual's "Deploying" page has the --network host form for an API on loopback.)
# Arguments given to `docker run` replace CMD (which is `--state-dir /var/lib/tollgate`): keep
# --state-dir among them for buckets that survive a restart.
#
# Without one, the same runtime from a local base image and a binary built outside it (an image
# holding /out/tollgate and an empty /out/state directory); scripts/image.sh does this:
#   podman build --pull=never --target runtime-prebuilt \
#       --build-arg RUNTIME_BASE=localhost/tollgate-base:bookworm \
#       --build-arg BINARY_IMAGE=localhost/tollgate-binary:local -t tollgate .
# A stage the target does not need (here `build`) is skipped, so nothing is pulled.

# The runtime's base: distroless "cc" (glibc, libgcc, CA certificates; user nonroot = 65532).
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot
# For the runtime-prebuilt target: the image holding /out/tollgate and /out/state.
ARG BINARY_IMAGE=scratch

# The compiler pgo/rustc-version names: under another one the profile matches no function, and
# the binary is a plain release build's code (tests/deploy.rs checks the two agree).
FROM rust:1.95.0-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake xz-utils \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Everything the manifest and scripts/shipped-build.sh read (tests/deploy.rs builds the
# manifest from exactly these): the carried Pingora crates, and the load harness's bare proxy,
# built beside tollgate so that the profile's symbols match.
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY benches benches
COPY examples examples
COPY vendor vendor
COPY pgo pgo
COPY scripts/shipped-build.sh scripts/shipped-build.sh
RUN bash scripts/shipped-build.sh \
    && mkdir -p /out/state \
    && strip -o /out/tollgate target/shipped/release/tollgate

# The runtime, but its binary and state dir: the two targets below add them.
FROM ${RUNTIME_BASE} AS runtime-config
COPY policies/axum-per-ip.json /etc/tollgate/policy.json
USER 65532:65532
# Proxy listener and admin listener (decision service, /livez, /readyz, /metrics). The admin
# listener binds all interfaces inside the container so the port can be published; publish it
# only to trusted networks.
EXPOSE 8080 9090
ENV TOLLGATE_POLICY=/etc/tollgate/policy.json \
    TOLLGATE_LISTEN=0.0.0.0:8080 \
    TOLLGATE_ADMIN_LISTEN=0.0.0.0:9090
# SIGTERM drains: listeners close, requests in flight get 1 s to finish (longer ones are cut),
# and the process exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/tollgate", "run"]
# A default argument rather than ENV, so a deployment that cannot give it a private volume (on
# Kubernetes an emptyDir is world-writable, which --state-dir refuses) leaves it out by giving
# its own arguments.
CMD ["--state-dir", "/var/lib/tollgate"]

# The runtime from a binary built elsewhere (scripts/image.sh). The lines after FROM are the
# same as the default target's below but for --from (tests/deploy.rs checks).
FROM ${BINARY_IMAGE} AS prebuilt
FROM runtime-config AS runtime-prebuilt
COPY --from=prebuilt /out/tollgate /usr/local/bin/tollgate
# The state dir (--state-dir): owned by the runtime user, writable by nobody else, as tollgate
# requires. A named volume takes this owner on first use; a bind mount must be chowned to 65532.
COPY --from=prebuilt --chown=65532:65532 /out/state /var/lib/tollgate
WORKDIR /var/lib/tollgate
VOLUME ["/var/lib/tollgate"]

# The default target: the runtime with the binary built above.
FROM runtime-config AS runtime
COPY --from=build /out/tollgate /usr/local/bin/tollgate
# The state dir (--state-dir): owned by the runtime user, writable by nobody else, as tollgate
# requires. A named volume takes this owner on first use; a bind mount must be chowned to 65532.
COPY --from=build --chown=65532:65532 /out/state /var/lib/tollgate
WORKDIR /var/lib/tollgate
VOLUME ["/var/lib/tollgate"]
