# syntax=docker/dockerfile:1
# The operator image: shardwise with the `operator` extra (kopf, kubernetes, prometheus-client) and no torch.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/shardwise/operator:0.1.0 .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
# Every package folder is copied: pyproject.toml maps each one, and the build needs them all present
# (the worker's modules are imported only by `shardwise serve/train/worker`, never by the operator).
COPY pyproject.toml README.md ./
COPY shardwise/ shardwise/
COPY crds/ crds/
COPY operator/ operator/
COPY worker/ worker/
COPY e2e/ e2e/
# Wheels of shardwise and its operator dependencies, so the final stage installs offline and carries no
# build tools or sources.
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[operator]"

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --gid 10001 shardwise \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin shardwise
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "shardwise[operator]" \
 && rm -rf /wheels \
 && { python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
      || { echo "the operator image must not contain torch" >&2; exit 1; }; }
# The root filesystem is mounted read-only in the chart: no bytecode written at run time.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["shardwise"]
CMD ["operator", "run", "--all-namespaces"]
