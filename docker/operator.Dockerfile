# syntax=docker/dockerfile:1.7
# The FineTuneJob operator: the memstrata core plus Kopf and the Kubernetes client; no torch.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/memstrata/operator:0.1.0 .
# (BuildKit reads docker/operator.Dockerfile.dockerignore for this build.)
FROM python:3.11-slim-bookworm AS build
# The wheel always carries memstrata.runtime._native; it links liburing and libnuma.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev liburing-dev libnuma-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY native/ native/
COPY operator/ operator/
COPY runtime/ runtime/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# The operator never imports the native extension, so its libraries are not installed here.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/memstrata-*.whl)[operator]"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Non-root, numeric, so PodSecurity `restricted` (runAsNonRoot) can verify it.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["memstrata"]
CMD ["operator", "--liveness=http://0.0.0.0:8080/healthz"]
