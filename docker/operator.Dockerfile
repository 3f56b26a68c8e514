# syntax=docker/dockerfile:1.7
# The FineTuneJob operator: the operator floor (`memstrata`, from operator/) plus Kopf and the
# Kubernetes client. No torch, no DeepSpeed, no native extension, no compiler.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/memstrata/operator:0.1.0 .
# Without Docker or a registry (the real-node tests): `python -m e2e.realnode.images build` makes
# the same image from Debian's python3 and the CI venv; keep user, entrypoint and env in step.
# (BuildKit reads docker/operator.Dockerfile.dockerignore for this build.)
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./operator

FROM python:3.11-slim-bookworm
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(ls /wheels/memstrata-*.whl)[operator]"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Non-root, numeric, so PodSecurity `restricted` (runAsNonRoot) can verify it.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["memstrata"]
CMD ["operator", "--liveness=http://0.0.0.0:8080/healthz"]
