# The operator image: shardwise with the `operator` extra (kopf, kubernetes, prometheus-client, aiohttp for `shardwise router`) and no torch.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/shardwise/operator:0.1.0 .
# BASE_IMAGE is any image with python3 (>= 3.11) and its venv module: the public Python image by
# default, or shardwise/python:3.11 (docker/python-base.Dockerfile) where no registry is reachable.
# EXTRA_CA_CERTS (PEM text) is trusted by pip during the build only, for TLS-intercepting proxies; it
# stays in the first stage, never in the image.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG EXTRA_CA_CERTS=
# Every package folder is copied: pyproject.toml maps each one, and the build needs them all present
# (the worker's modules are imported only by `shardwise serve/train/worker`, never by the operator).
COPY pyproject.toml README.md /src/
COPY shardwise/ /src/shardwise/
COPY crds/ /src/crds/
COPY operator/ /src/operator/
COPY worker/ /src/worker/
COPY e2e/ /src/e2e/
COPY docker/pip-ca.sh /usr/local/bin/pip-ca
RUN python3 -m venv /opt/shardwise \
 && pip-ca /opt/shardwise/bin/pip install --no-cache-dir "/src[operator]" \
 && { /opt/shardwise/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
      || { echo "the operator image must not contain torch" >&2; exit 1; }; }

FROM ${BASE_IMAGE}
RUN groupadd --gid 10001 shardwise \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin shardwise
COPY --from=build /opt/shardwise /opt/shardwise
# The root filesystem is mounted read-only in the chart: no bytecode written at run time.
ENV PATH=/opt/shardwise/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["shardwise"]
CMD ["operator", "run", "--all-namespaces"]
