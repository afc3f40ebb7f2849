# syntax=docker/dockerfile:1
# Three images from one file (the Helm chart runs them):
#   docker build --target router  -t ghcr.io/radix-router/router:0.1.0 .
#   docker build --target worker  -t ghcr.io/radix-router/worker:0.1.0 .
#   docker build --target sidecar -t ghcr.io/radix-router/sidecar:0.1.0 .
# The router image carries no torch (the router never imports `worker`); the worker image
# starts from a CUDA PyTorch runtime; the sidecar (slim, no torch) runs `radix-worker
# attach` next to stock SGLang / vLLM images and `radix-worker download` as the init
# container that fills the model cache.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

# ---------------------------------------------------------------- slim bases
# What the router and sidecar images (no torch) share: a venv to build into, and a
# runtime with the non-root user the chart's securityContext names.
FROM ${PYTHON_IMAGE} AS slim-build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

FROM ${PYTHON_IMAGE} AS slim
RUN groupadd --system --gid 10001 radix \
    && useradd --system --uid 10001 --gid radix --no-create-home --home-dir /tmp radix
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# ---------------------------------------------------------------- router: build
FROM slim-build AS router-build
# Only the packages the router needs: setuptools packages what it finds, so worker/ is
# left out of this image entirely.
COPY pyproject.toml README* ./
COPY shared/ shared/
COPY router/ router/
RUN pip install --no-cache-dir .

# ---------------------------------------------------------------- router
FROM slim AS router
COPY --from=router-build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8000
# Same port the service uses: RADIX_ROUTER_PORT when set (the config model's env override).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('RADIX_ROUTER_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["radix-router"]
CMD ["serve"]

# ---------------------------------------------------------------- worker
FROM ${TORCH_IMAGE} AS worker
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/radix-router
COPY pyproject.toml README* ./
COPY shared/ shared/
COPY worker/ worker/
# torch comes from the base image and already satisfies the worker extra, so pip keeps it.
# The pip check fails the build if anything was left with a broken requirement.
# DL3013 (pin versions) misreads the local project ".[worker]" as an unpinned package.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[worker]" \
    && pip check \
    && python -c "import torch, worker, shared; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# A home the non-root user can write: torch and triton keep caches under it.
RUN groupadd --system --gid 10001 radix \
    && useradd --system --uid 10001 --gid radix --create-home --home-dir /home/radix radix
ENV HOME=/home/radix
USER 10001:10001
EXPOSE 8001
# /health answers 503 until the model is loaded: give loading a long start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=4 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('RADIX_WORKER_PORT', '8001'), timeout=4)"]
ENTRYPOINT ["radix-worker"]
CMD ["serve"]

# ---------------------------------------------------------------- sidecar: build
FROM slim-build AS sidecar-build
# The worker package without its engine's dependencies (attach and download import no
# torch), plus huggingface_hub for download.
COPY pyproject.toml README* ./
COPY shared/ shared/
COPY worker/ worker/
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[sidecar]"

# ---------------------------------------------------------------- sidecar
FROM slim AS sidecar
COPY --from=sidecar-build /opt/venv /opt/venv
ENV HF_HOME=/tmp/hf
USER 10001:10001
ENTRYPOINT ["radix-worker"]
CMD ["attach", "--help"]
