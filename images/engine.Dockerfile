# syntax=docker/dockerfile:1
# The dsv4 engine image: `dsv4 serve` (prefill / decode / mono) and `dsv4 router`, built from this
# repository. Build from the repository root:
#   docker build -f images/engine.Dockerfile -t dsv4-engine:0.1.0 .
# GPU nodes use the default CUDA base (its NVIDIA_* variables make the container toolkit mount
# the driver; torch brings its own CUDA libraries). A CPU-only build for tests (kind, no GPU):
#   docker build -f images/engine.Dockerfile --target tiny \
#     --build-arg BASE_IMAGE=ubuntu:24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t dsv4-engine:tiny-cpu .
# (`--target tiny` also bakes the tiny test model into /models/tiny.)
# Both bases are Ubuntu 24.04, so the build stage's Python matches the runtime's.
ARG BASE_IMAGE=nvidia/cuda:12.9.1-base-ubuntu24.04

# ---- build: a virtual environment with the engine and its pinned dependencies ----------------
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=""
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's own python3 (3.12 on 24.04); apt versions follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
# torch first, at the version pyproject pins (read from it, so the pin lives in one place): an
# unpinned torch pulls whichever build pip finds first. TORCH_INDEX_URL picks a CPU build.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m venv /opt/dsv4 \
 && TORCH_REQ="$(python3 -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(d for d in deps if d.startswith("torch")))')" \
 && /opt/dsv4/bin/pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_REQ"
COPY cli cli
COPY engine engine
COPY kernels kernels
COPY operator operator
COPY router router
COPY wire wire
RUN /opt/dsv4/bin/pip install --no-cache-dir . \
 && /opt/dsv4/bin/pip check \
 && /opt/dsv4/bin/dsv4 serve --help >/dev/null

# ---- runtime: the virtual environment, a non-root user, nothing to build with ----------------
FROM ${BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher the first time a kernel runs on a GPU: it needs a C compiler
# and Python's headers at run time, not only at build time.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 dsv4 \
 && useradd --system --uid 10001 --gid dsv4 --home-dir /home/dsv4 --create-home dsv4 \
 && mkdir -p /models \
 && chown dsv4:dsv4 /models
COPY --from=build /opt/dsv4 /opt/dsv4
# The CPU backend's native kernels, built once here for named ISA levels (amd64: x86-64-v4, -v3
# and -v2; arm64: armv8-a; NATIVE_ISA=LEVEL for one), root's and read-only to the engine user,
# which loads its CPU's level from DSV4_NATIVE_DIR: no pod rebuilds them.
ARG NATIVE_ISA=""
RUN /opt/dsv4/bin/python -m dsv4_kernels.build_native /opt/dsv4/native ${NATIVE_ISA:+--isa "$NATIVE_ISA"} \
 && chmod -R go-w /opt/dsv4/native
ENV PATH=/opt/dsv4/bin:$PATH \
    DSV4_NATIVE_DIR=/opt/dsv4/native \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/home/dsv4
WORKDIR /home/dsv4
USER 10001:10001
# 8100: OpenAI API, /health, /ready, /metrics; 8998: the prefill bootstrap endpoint.
EXPOSE 8100 8998
ENTRYPOINT ["dsv4", "serve"]
CMD ["--help"]

# ---- tiny: the runtime plus the tiny test checkpoint at /models/tiny (CPU tests, kind e2e) --------
FROM runtime AS tiny
RUN dsv4 model init /models/tiny --preset tiny --seed 0

# ---- the default target: the runtime image -----------------------------------------------------
FROM runtime
