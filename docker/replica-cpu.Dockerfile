# syntax=docker/dockerfile:1.7
# A replica (scheduler + engine) on the CPU: torch's CPU build. For kind/minikube and
# for clusters without GPUs; runs the random tiny model when no weights are mounted.
#   docker build -f docker/replica-cpu.Dockerfile -t cachepoint-replica-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: a venv with the CPU torch first (pinned, from PyTorch's CPU index, so pip
# never pulls the multi-GB CUDA build), then the project with the replica extra.
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv && /opt/venv/bin/pip install pip==24.3.1
RUN /opt/venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
COPY docker/constraints.txt docker/constraints.txt
COPY pyproject.toml setup.py README.md ./
COPY services services
COPY gateway gateway
COPY operator operator
RUN /opt/venv/bin/pip install --constraint docker/constraints.txt ".[replica]" \
 && /opt/venv/bin/python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__" \
 && /opt/venv/bin/cachepoint-replica --help > /dev/null
# The engine's CPU attention kernel (services/engine/csrc), compiled against this torch
# into the venv, so the run stage needs no compiler; --any-cpu: the build machine's CPU
# may lack the AVX-512 the nodes have (where they lack it, torch's kernels serve).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
 && rm -rf /var/lib/apt/lists/* \
 && /opt/venv/bin/python -m cachepoint.engine.build_kernel --any-cpu

# ---- run: the venv alone, as an unprivileged user
FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 cachepoint \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/cachepoint --shell /usr/sbin/nologin cachepoint
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/cachepoint
EXPOSE 8100
ENTRYPOINT ["cachepoint-replica"]
CMD ["--host", "0.0.0.0", "--device", "cpu"]
