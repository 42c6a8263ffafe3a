# tollgate's image: a build stage (fat-LTO `perf` profile) and a runtime stage with no shell and
# no package manager: glibc, libgcc and the CA certificates, the binary, the shipped policy.
#
# With a registry (the build stage compiles from source):
#   docker build -t tollgate .            (or: podman build -t tollgate .)
#   docker run -p 8080:8080 -p 9090:9090 -v tollgate-state:/var/lib/tollgate \
#       tollgate --state-dir /var/lib/tollgate --upstream host.docker.internal:3000
# Arguments given to `docker run` replace CMD (which is `--state-dir /var/lib/tollgate`): keep
# --state-dir among them for buckets that survive a restart.
#
# Without one, the runtime stage alone, from a local base image and a binary built outside (an
# image holding /out/tollgate and an empty /out/state directory); scripts/image.sh does this:
#   podman build --pull=never --target runtime \
#       --build-arg RUNTIME_BASE=localhost/tollgate-base:bookworm \
#       --build-arg BINARY_FROM=localhost/tollgate-binary:local -t tollgate .
# A stage nothing needs (here `build`) is skipped, so nothing is pulled.

# The runtime's base: distroless "cc" (glibc, libgcc, CA certificates; user nonroot = 65532).
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot
# Where /out/tollgate comes from: the `build` stage, or an image built elsewhere.
ARG BINARY_FROM=build

FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY benches benches
RUN cargo build --profile perf --locked --bin tollgate \
    && mkdir -p /out/state \
    && strip -o /out/tollgate target/perf/tollgate

FROM ${BINARY_FROM} AS binary

FROM ${RUNTIME_BASE} AS runtime
COPY --from=binary /out/tollgate /usr/local/bin/tollgate
COPY policies/axum-per-ip.json /etc/tollgate/policy.json
# The state dir (--state-dir): owned by the runtime user, writable by nobody else, as tollgate
# requires. A named volume takes this owner on first use; a bind mount must be chowned to 65532.
COPY --from=binary --chown=65532:65532 /out/state /var/lib/tollgate
USER 65532:65532
WORKDIR /var/lib/tollgate
VOLUME ["/var/lib/tollgate"]
# Proxy listener and admin listener (decision service, /livez, /readyz, /metrics). The admin
# listener binds all interfaces inside the container so the port can be published; publish it
# only to trusted networks.
EXPOSE 8080 9090
ENV TOLLGATE_POLICY=/etc/tollgate/policy.json \
    TOLLGATE_LISTEN=0.0.0.0:8080 \
    TOLLGATE_ADMIN_LISTEN=0.0.0.0:9090
# SIGTERM drains: listeners close, requests in flight finish (1 s grace, then up to 10 s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/tollgate", "run"]
# A default argument rather than ENV, so a deployment that cannot give it a private volume (on
# Kubernetes an emptyDir is world-writable, which --state-dir refuses) leaves it out by giving
# its own arguments.
CMD ["--state-dir", "/var/lib/tollgate"]
