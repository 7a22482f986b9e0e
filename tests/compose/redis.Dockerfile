# Redis from Debian's redis-server package, for the compose test (no registry reachable here, so not
# valkey/valkey as in compose.yaml). Built FROM the debootstrap base image tests/compose/ makes.
ARG BASE_IMAGE=fleet-test-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no", "--dir", "/data"]
