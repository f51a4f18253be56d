# syntax=docker/dockerfile:1
# The moeserve image. On Kubernetes every container of the RayService runs it: the Ray
# head, the Ray workers and KubeRay's autoscaler sidecar (which defaults to the head's image).
#
#   CPU image (k8s/overlays/dev-cpu), with the CPU build of torch from its wheel index:
#     docker build --build-arg TORCH_INDEX_URL=<URL of the PyTorch CPU wheel index> -t moeserve:latest .
#   GPU image (k8s/overlays/prod-gpu): leave TORCH_INDEX_URL empty; torch's default Linux
#   wheel on PyPI is the CUDA build, which brings its CUDA libraries as pip packages (the
#   driver comes from the node through the NVIDIA container toolkit):
#     docker build -t moeserve:gpu .
#
# What KubeRay needs from an image: it replaces the container's command with
# `/bin/bash -lc -- "ulimit ...; ray start ..."` (head and workers) and
# `ray kuberay-autoscaler ...` (the autoscaler sidecar), and its injected readiness probes
# exec `wget ... | grep success` against the raylet, the dashboard and the Serve proxy. So:
# bash, wget and `ray` on PATH, the same Python and Ray everywhere (one image), and no
# ENTRYPOINT that would wrap KubeRay's command. CMD only matters for a plain `docker run`.
FROM python:3.11-slim

# Must equal spec.rayClusterConfig.rayVersion in k8s/base/rayservice.yaml (a test checks):
# KubeRay picks probe styles and features by that version.
ARG RAY_VERSION=2.60.0
ARG TORCH_VERSION=2.13.0
ARG XGRAMMAR_VERSION=0.2.9
# Empty: torch from pip's default index. No host is named here on purpose.
ARG TORCH_INDEX_URL=""

# Weights are baked in or mounted: nothing is fetched from a model hub at run time.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*

# 1. torch first and alone, so that the index chosen above decides CPU vs CUDA and nothing
#    later pulls a different build.
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

WORKDIR /app

# 2. The project's dependencies, from pyproject.toml alone: this layer is rebuilt only when
#    the dependency list changes, not on every code change. Ray is pinned to RAY_VERSION;
#    repeating torch's pin keeps pip from replacing the build installed above.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.docker.txt \
    && pip install -r requirements.docker.txt "ray[serve]==${RAY_VERSION}" "torch==${TORCH_VERSION}" \
    && rm requirements.docker.txt

# 3. xgrammar without its declared dependencies: they pull triton (~1 GB), which the CPU
#    path never uses (a GPU image that wants xgrammar's triton kernels can add it here).
RUN pip install --no-deps "xgrammar==${XGRAMMAR_VERSION}"

# 4. The code, then the project itself, editable: Serve imports
#    `deployments.app:build_app` from /app, and the served config's relative paths
#    (checkpoints/demo-moe, ...) resolve against the folder holding deployments/, so the
#    code must be imported from /app, not from a copy in site-packages.
COPY moeserve/ moeserve/
COPY model_shards/ model_shards/
COPY router_service/ router_service/
COPY deployments/ deployments/
# (checkpoints/ is mapped into the package as moeserve.checkpoints: it must exist at install time)
RUN mkdir -p checkpoints && pip install --no-deps -e . \
    && python -m compileall -q moeserve model_shards router_service deployments \
    && python -c "import torch, transformers, xgrammar, ray, deployments.app"

# 5. The demo checkpoints (what the base Serve config serves), last: they change more often
#    than the dependencies and are larger than the code.
COPY checkpoints/ checkpoints/

# Non-root, with a fixed numeric uid so that `runAsNonRoot` can verify it. /app stays
# root-owned and read-only; Ray writes its session files under the system temp folder (KubeRay mounts volumes there and on
# /dev/shm) and caches go to the home directory.
RUN groupadd --gid 1000 ray && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash ray
USER 1000:1000
ENV HOME=/home/ray

# Ray GCS, Ray client, dashboard, Ray metrics, Serve HTTP, moeserve gRPC.
EXPOSE 6379 10001 8265 8080 8000 9000

# `docker run -p 8000:8000 -p 9000:9000 moeserve:latest` serves the demo on one node
# (`moeserve serve` starts its own Ray with token auth off, like `scripts/run.sh`).
# On Kubernetes this is replaced by KubeRay's `ray start`.
CMD ["moeserve", "serve", "--config", "deployments/serve_config.yaml", "--host", "0.0.0.0"]
