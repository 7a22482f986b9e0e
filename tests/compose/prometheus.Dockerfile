# Prometheus from Debian's prometheus package, for the compose test (compose.yaml uses
# prom/prometheus, which no registry here serves). Same flags, same mounted config.
ARG BASE_IMAGE=fleet-test-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
