# syntax=docker/dockerfile:1.7
# The node agent (discovery + device plugin). Runs privileged as root in a DaemonSet: it reads
# the host's /sys, the first sectors of NVMe namespaces and the kubelet's device-plugin socket dir.
#   docker build -f docker/node-agent.Dockerfile -t ghcr.io/memstrata/node-agent:0.1.0 .
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev liburing-dev libnuma-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY native/ native/
COPY operator/ operator/
COPY runtime/ runtime/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# grpcio (device plugin API) and the Kubernetes client come with the `operator` extra.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/memstrata-*.whl)[operator]"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
ENTRYPOINT ["memstrata"]
CMD ["nodeagent"]
