# syntax=docker/dockerfile:1
# The kvtier sidecar image: `kvtier serve` as a non-root user, ready for a read-only root filesystem.
# llama-server runs beside it from its upstream image (see helm/kvtier).
#
#   docker build -t REGISTRY/kvtier:0.1.0 --build-arg VERSION=0.1.0 \
#     --build-arg REVISION="$(git rev-parse HEAD)" .

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# ---- build: a virtual environment with kvtier and its dependencies (all from wheels) ----------
FROM ${PYTHON_IMAGE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# The venv gets no pip or setuptools of its own: the build stage's pip installs into it
# (--python), so the final image carries no installer and no build backend.
RUN python -m venv --without-pip /opt/kvtier

WORKDIR /src
# .dockerignore lets in only pyproject.toml, README.md and the Python packages.
COPY . .
# Dependencies only as wheels (the slim base has no compiler); [zstd] so every --compress choice works.
RUN pip --python /opt/kvtier/bin/python install --no-cache-dir \
      --only-binary=:all: --no-binary=kvtier "./[zstd]"

# ---- runtime -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}

# An ARG declared before the first FROM is only in scope here once declared again.
ARG PYTHON_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="kvtier" \
      org.opencontainers.image.description="Redis-backed, tiered KV-cache sidecar for llama.cpp servers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"

# A fixed numeric uid/gid (10001): Kubernetes can verify runAsNonRoot against it, and the chart's
# podSecurityContext uses the same ids.
RUN groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid kvtier --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvtier \
 && install -d -o 10001 -g 10001 -m 0755 /var/lib/kvtier /var/lib/kvtier/slots /var/lib/kvtier/shared

COPY --from=build /opt/kvtier /opt/kvtier

# Bytecode was compiled at install time; nothing is written outside the mounted volumes
# (slot dir, shared dir, /tmp), so the root filesystem can be read-only.
ENV PATH=/opt/kvtier/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp

USER 10001:10001
WORKDIR /var/lib/kvtier
EXPOSE 8081

ENTRYPOINT ["kvtier", "serve"]
CMD ["--slot-dir", "/var/lib/kvtier/slots"]
