# syntax=docker/dockerfile:1
# The dsv4 operator image: `dsv4 operator` on slim Python, without the engine's heavy dependencies
# (torch, Triton, NIXL, ...), which the operator never imports. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t dsv4-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with the operator's pinned dependencies ---------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scripts/operator_requirements.py scripts/
# pyproject's pins minus the engine-only packages (scripts/operator_requirements.py says which).
RUN python -m venv /opt/dsv4 \
 && python scripts/operator_requirements.py pyproject.toml > /tmp/requirements.txt \
 && /opt/dsv4/bin/pip install --no-cache-dir -r /tmp/requirements.txt
COPY cli cli
COPY engine engine
COPY kernels kernels
COPY operator operator
COPY router router
COPY wire wire
# The project itself without its engine dependencies; then prove the operator starts its CLI.
RUN /opt/dsv4/bin/pip install --no-cache-dir --no-deps . \
 && /opt/dsv4/bin/python -c "import dsv4_operator.main" \
 && /opt/dsv4/bin/dsv4 operator --help >/dev/null

# ---- runtime ---------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 dsv4 \
 && useradd --system --uid 10001 --gid dsv4 --home-dir /home/dsv4 --create-home dsv4
COPY --from=build /opt/dsv4 /opt/dsv4
# No bytecode writes: the chart runs the operator on a read-only root filesystem.
ENV PATH=/opt/dsv4/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/dsv4
WORKDIR /home/dsv4
USER 10001:10001
# /healthz and /metrics.
EXPOSE 8080
ENTRYPOINT ["dsv4", "operator"]
CMD ["--standalone"]
