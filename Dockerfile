# vae-service images. CPU (the default target):  docker build -t vae-service .
#                     CUDA:                      docker build --target cuda -t vae-service:cuda .
# Run: docker run -p 8000:8000 -e VAE_SERVICE_AUTH_TOKEN=... -v /path/to/vae:/models/vae:ro \
#        vae-service vae-service serve --host 0.0.0.0 --model /models/vae
# The default model is the `sd` preset with seeded random weights: it decodes noise.
# HEALTHCHECK probes Serve's proxy liveness route, which never waits behind decodes.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG CUDA_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

FROM ${CUDA_IMAGE} AS cuda
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 vae
WORKDIR /app
COPY clients ./clients
COPY pyproject.toml README.md ./
COPY vae_service ./vae_service
COPY deploy ./deploy
# torch comes with the image (CUDA build); the service's other dependencies on top
RUN pip install ./clients .
USER 10001
EXPOSE 8000 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/-/healthz', timeout=4)"]
CMD ["vae-service", "serve", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]

FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 vae
WORKDIR /app
# torch first and pinned (TORCH_SPEC): an unpinned torch would pull a multi-GB CUDA build
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
COPY clients ./clients
COPY pyproject.toml README.md ./
COPY vae_service ./vae_service
COPY deploy ./deploy
RUN pip install ./clients .
USER 10001
EXPOSE 8000 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/-/healthz', timeout=4)"]
CMD ["vae-service", "serve", "--host", "0.0.0.0", "--port", "8000"]
