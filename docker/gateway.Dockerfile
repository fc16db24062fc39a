# syntax=docker/dockerfile:1.7
# The gateway: Messages API, routing, billing. CPU only, no torch.
#   docker build -f docker/gateway.Dockerfile -t cachepoint-gateway:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: a venv with the project and its pinned dependencies
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv && /opt/venv/bin/pip install pip==24.3.1
WORKDIR /src
COPY docker/constraints.txt docker/constraints.txt
COPY pyproject.toml setup.py README.md ./
COPY services services
COPY gateway gateway
COPY operator operator
RUN /opt/venv/bin/pip install --constraint docker/constraints.txt . \
 && /opt/venv/bin/cachepoint-gateway --help > /dev/null

# ---- run: the venv alone, as an unprivileged user
FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 cachepoint \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cachepoint
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["cachepoint-gateway"]
CMD ["--host", "0.0.0.0", "--port", "8080"]
