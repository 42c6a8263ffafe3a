# Multi-stage build: compile with the fat-LTO `perf` profile, ship a slim runtime image that
# runs as a non-root user with an example policy.
#   docker build -t tollgate .
#   docker run -p 8080:8080 -p 9090:9090 tollgate --upstream host.docker.internal:3000
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY benches benches
RUN cargo build --profile perf --locked && strip target/perf/tollgate

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home tollgate
COPY --from=build /src/target/perf/tollgate /usr/local/bin/tollgate
COPY policies/axum-per-ip.json /etc/tollgate/policy.json
USER tollgate
# Proxy listener and admin listener (decision service, /livez, /readyz, /metrics). The admin
# listener binds all interfaces inside the container so the port can be published; publish it
# only to trusted networks.
EXPOSE 8080 9090
ENV TOLLGATE_POLICY=/etc/tollgate/policy.json \
    TOLLGATE_LISTEN=0.0.0.0:8080 \
    TOLLGATE_ADMIN_LISTEN=0.0.0.0:9090
ENTRYPOINT ["/usr/local/bin/tollgate", "run"]
