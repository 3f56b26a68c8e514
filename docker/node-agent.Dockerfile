# syntax=docker/dockerfile:1.7
# The node agent (discovery + device plugin): the operator floor alone, like the operator image.
# Discovery and the namespace safety rules are pure Python (memstrata.node); no torch, no native
# extension. Runs privileged as root in a DaemonSet: it reads the host's /sys, the first sectors
# of NVMe namespaces and the kubelet's device-plugin socket dir.
#   docker build -f docker/node-agent.Dockerfile -t ghcr.io/memstrata/node-agent:0.1.0 .
# Without Docker or a registry (the real-node tests): `python -m e2e.realnode.images build` makes
# the same image from Debian's python3 and the CI venv; keep user, entrypoint and env in step.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./operator

FROM python:3.11-slim-bookworm
# grpcio (device plugin API) and the Kubernetes client come with the `nodeagent` extra.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/memstrata-*.whl)[nodeagent]"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
ENTRYPOINT ["memstrata"]
CMD ["nodeagent"]
