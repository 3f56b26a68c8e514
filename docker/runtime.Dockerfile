# syntax=docker/dockerfile:1.7
# The training runtime: torch, DeepSpeed with its async_io and cpu_adam ops compiled at build time
# (so a pod never spends minutes JIT-compiling), and memstrata's native engine.
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/memstrata/runtime:0.1.0 .
# Without Docker or a registry (the real-node tests): `python -m e2e.realnode.images build` makes
# the same image from Debian's python3 and the CI venv; keep user, entrypoint and env in step.
ARG TORCH_VERSION=2.13.0
ARG DS_VERSION=0.19.8

FROM python:3.11-slim-bookworm AS build
ARG TORCH_VERSION DS_VERSION
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential libaio-dev liburing-dev libnuma-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" numpy ninja setuptools wheel
# Same flags as scripts/bootstrap-venv: the ops are built against this exact torch.
RUN DS_BUILD_OPS=0 DS_BUILD_AIO=1 DS_BUILD_CPU_ADAM=1 \
    pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels "deepspeed==${DS_VERSION}"
WORKDIR /src
# Both floors: the runtime imports the operator floor's contracts and planner.
COPY operator/ operator/
COPY runtime/ runtime/
COPY native/ native/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./operator ./runtime

FROM python:3.11-slim-bookworm
ARG TORCH_VERSION
# Shared libraries of the native engine and of DeepSpeed's async_io op.
RUN apt-get update && apt-get install -y --no-install-recommends liburing2 libnuma1 libaio1 \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir "torch==${TORCH_VERSION}" /wheels/deepspeed-*.whl \
        /wheels/memstrata-0*.whl /wheels/memstrata_runtime-*.whl
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# uid 1000 matches the operator's pod securityContext (memstrata.api.podidentity.RUNTIME_UID).
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin memstrata
USER 1000:1000
WORKDIR /home/memstrata
# The operator mounts the RuntimeConfig and sets $MEMSTRATA_RUNTIME_CONFIG; `memstrata pod` trains
# from it and patches the job's status. A FineTuneJob's spec.command overrides both.
ENV MEMSTRATA_SCRATCH=/var/tmp/memstrata
ENTRYPOINT ["memstrata"]
CMD ["pod"]
