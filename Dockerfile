# One image with the `automesh` binary; docker-compose.yml picks the service
# by subcommand.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p automesh

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/automesh /usr/local/bin/automesh
# The local-process driver's worker directories (a volume in compose).
RUN mkdir -p /var/lib/automesh/workers && chown -R nobody /var/lib/automesh
USER nobody
ENTRYPOINT ["automesh"]
