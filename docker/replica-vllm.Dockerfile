# syntax=docker/dockerfile:1.7
# A replica on vLLM's engine (`cachepoint-replica --engine vllm`, issue 18), on NVIDIA
# GPUs: PyTorch's CUDA runtime base, vLLM's CUDA build beside its torch, then the
# project. Everything but torch and vLLM's CUDA packages is pinned to what the vLLM
# tests ran against (docker/constraints-vllm.txt, frozen from .venv-vllm).
#   docker build -f docker/replica-vllm.Dockerfile -t cachepoint-replica-vllm:0.1.0 .
# NOTE: vLLM's kernels are compiled against one torch and one CUDA: PyPI's vllm wheel is
# built with CUDA 12.9 for torch 2.13, so the base is torch 2.13's cu129 image (not
# replica-cuda's cu126). CUDA 12.9 wants an R575+ driver, or R525+ through CUDA's
# minor-version compatibility (docs/deploy.md). The build stops if torch was replaced.
ARG TORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.9-cudnn9-runtime

# ---- build: a venv that sees the base image's torch, vLLM, then the project
FROM ${TORCH_IMAGE} AS build
ARG VLLM_VERSION=0.32.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu129
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -c "import sys; assert sys.version_info[:2] == (3, 11), 'base image needs Python 3.11, has ' + sys.version" \
 && python -m venv --system-site-packages /opt/venv \
 && /opt/venv/bin/pip install pip==24.3.1
WORKDIR /src
COPY docker/constraints-vllm.txt docker/constraints-vllm.txt
RUN TORCH_BEFORE="$(python -c 'import torch; print(torch.__version__)')" \
 && /opt/venv/bin/pip install --constraint docker/constraints-vllm.txt --extra-index-url "${TORCH_INDEX}" "vllm==${VLLM_VERSION}" \
 && /opt/venv/bin/python -c "import torch, sys; assert torch.__version__ == sys.argv[1] and torch.version.cuda, 'vLLM replaced the base torch: ' + torch.__version__" "$TORCH_BEFORE"
COPY pyproject.toml setup.py README.md ./
COPY services services
COPY gateway gateway
COPY operator operator
RUN /opt/venv/bin/pip install --constraint docker/constraints-vllm.txt ".[replica]" \
 && /opt/venv/bin/python -c "import vllm, cachepoint.replica.vllm_engine.core" \
 && /opt/venv/bin/cachepoint-replica --help > /dev/null

# ---- run: the same base, the venv copied over, as an unprivileged user
FROM ${TORCH_IMAGE}
RUN groupadd --gid 10001 cachepoint \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/cachepoint --shell /usr/sbin/nologin cachepoint
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    XDG_CACHE_HOME=/home/cachepoint/.cache
USER 10001:10001
WORKDIR /home/cachepoint
EXPOSE 8100
ENTRYPOINT ["cachepoint-replica"]
CMD ["--host", "0.0.0.0", "--device", "cuda", "--engine", "vllm"]
