# syntax=docker/dockerfile:1.7
# A replica (scheduler + engine) on NVIDIA GPUs, on PyTorch's CUDA runtime image: its
# torch is kept as is (never reinstalled), the project goes into a venv beside it.
#   docker build -f docker/replica-cuda.Dockerfile -t cachepoint-replica-cuda:0.1.0 .
# The base must carry Python 3.11 (the project's requires-python) and a torch within
# the replica extra's range (>=2.13,<2.14); the build stops with a message otherwise.
# NOTE: CUDA 12.6, not torch 2.13's default 13.0: a CUDA 13 runtime needs an R580+
# driver, which most managed GPU node images do not ship yet; 12.6 runs on R525+
# (CUDA 12 minor-version compatibility). torch 2.13 ships cu126, cu129, cu130, cu132.
ARG TORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime

# ---- build: a venv that sees the base image's torch (system site-packages)
FROM ${TORCH_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -c "import sys; assert sys.version_info[:2] == (3, 11), 'base image needs Python 3.11, has ' + sys.version" \
 && python -m venv --system-site-packages /opt/venv \
 && /opt/venv/bin/pip install pip==24.3.1
WORKDIR /src
COPY docker/constraints.txt docker/constraints.txt
COPY pyproject.toml setup.py README.md ./
COPY services services
COPY gateway gateway
COPY operator operator
# The base's torch satisfies the replica extra, so pip leaves it alone; the check after
# proves no CPU or other wheel replaced it.
RUN TORCH_BEFORE="$(python -c 'import torch; print(torch.__version__)')" \
 && /opt/venv/bin/pip install --constraint docker/constraints.txt ".[replica]" \
 && /opt/venv/bin/python -c "import torch, sys; assert torch.__version__ == sys.argv[1] and torch.version.cuda, torch.__version__" "$TORCH_BEFORE" \
 && /opt/venv/bin/cachepoint-replica --help > /dev/null

# ---- run: the same base, the venv copied over, as an unprivileged user
FROM ${TORCH_IMAGE}
RUN groupadd --gid 10001 cachepoint \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/cachepoint --shell /usr/sbin/nologin cachepoint
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/cachepoint
EXPOSE 8100
ENTRYPOINT ["cachepoint-replica"]
CMD ["--host", "0.0.0.0", "--device", "cuda"]
