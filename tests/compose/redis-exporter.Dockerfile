# Redis's Prometheus exporter from Debian's prometheus-redis-exporter package, for the compose test
# (compose.yaml uses oliver006/redis_exporter, which no registry here serves). Reads REDIS_ADDR as it does.
ARG BASE_IMAGE=fleet-test-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends prometheus-redis-exporter \
 && rm -rf /var/lib/apt/lists/*
USER nobody
EXPOSE 9121
ENTRYPOINT ["/usr/bin/prometheus-redis-exporter"]
