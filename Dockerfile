# syntax=docker/dockerfile:1
#
# teacher-server GPU image (H100/H200, sm_90).
#
#   docker build -t teacher-server .
#   docker run --gpus all -p 8000:8000 -v /path/to/Qwen3-32B:/models:ro teacher-server
#
# The checkpoint is never baked in: mount an HF checkpoint directory (config.json +
# safetensors) at /models, or mount a folder of checkpoints and point
# TEACHER_SERVER_MODEL at one of them (-e TEACHER_SERVER_MODEL=/models/Qwen3-32B).
# Every setting is an environment variable TEACHER_SERVER_<FIELD> (TEACHER_SERVER_PORT,
# TEACHER_SERVER_API_KEY, ...), or a YAML file passed as `--config /path/config.yaml`
# after the image name. The root filesystem may be read-only: the process writes only
# to /tmp and $XDG_CACHE_HOME.
#
# Build args: CUDA_VERSION / UBUNTU_VERSION pick the nvidia/cuda base images; TORCH_VERSION
# and TORCH_INDEX (the PyTorch wheel index matching CUDA 12.x) pick torch;
# FLASH_ATTN_VERSION and MAX_JOBS control the flash-attn source build (nvcc, sm_90 only).

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

# ---------------------------------------------------------------------------------------
# build: compilers + CUDA toolkit; produces /opt/venv and the prebuilt kernel extension.
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=cu128
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG MAX_JOBS=8

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# Package versions come from the Ubuntu release fixed by the base image tag; exact
# apt versions are dropped from the archive on every point update, so pinning them
# would break rebuilds without making them more reproducible.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev \
    && rm -rf /var/lib/apt/lists/*

RUN python3.12 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# torch first, from the CUDA wheel index, so the later installs keep this build; then
# the build tools flash-attn needs (its setup.py imports torch: --no-build-isolation).
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}" \
    && pip install --no-cache-dir setuptools==80.9.0 wheel==0.45.1 packaging==25.0 psutil==7.1.0 ninja==1.13.0

# Hopper only: one arch keeps the flash-attn build to a fraction of the full matrix and
# is the arch the gather-logprob kernel is built for below (TEACHER_SERVER_CUDA_ARCH; at
# run time the kernel cache is keyed by the GPU's own arch, 9.0 on H100/H200).
ENV TORCH_CUDA_ARCH_LIST="9.0" \
    FLASH_ATTN_CUDA_ARCHS="90" \
    TEACHER_SERVER_CUDA_ARCH="9.0"

# Its own layer: the slowest step, kept cached when only the project's sources change.
RUN MAX_JOBS="${MAX_JOBS}" pip install --no-cache-dir --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"

WORKDIR /src
COPY . .

# The same install the tests exercise: the package with its `cuda` extra.
RUN pip install --no-cache-dir --no-build-isolation "/src[cuda]"

# Build the gather-logprob CUDA extension now (no GPU needed, nvcc is here); the runtime
# image has no compiler and may mount its root filesystem read-only, and loads the cached
# library from TEACHER_SERVER_EXT_DIR without rebuilding.
ENV TEACHER_SERVER_EXT_DIR=/opt/teacher-server/ext
RUN mkdir -p "${TEACHER_SERVER_EXT_DIR}" \
    && python -m teacher_server.ops.gather_logprob

# ---------------------------------------------------------------------------------------
# runtime: CUDA runtime libraries + Python, no compilers.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime

ARG APP_UID=10001

# See the note in the build stage on apt pinning.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 \
    && rm -rf /var/lib/apt/lists/*

# Fixed numeric UID/GID so Kubernetes' runAsNonRoot can verify it and volume
# permissions (fsGroup) are predictable.
RUN groupadd --gid "${APP_UID}" teacher \
    && useradd --uid "${APP_UID}" --gid "${APP_UID}" --home-dir /home/teacher --create-home \
       --shell /usr/sbin/nologin teacher \
    && mkdir -p /models /home/teacher/.cache \
    && chown -R "${APP_UID}:${APP_UID}" /home/teacher

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/teacher-server/ext /opt/teacher-server/ext

# Caches (triton, inductor, HF) live under XDG_CACHE_HOME and /tmp, the only paths that
# need to be writable; Kubernetes mounts emptyDirs there.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/teacher \
    XDG_CACHE_HOME=/home/teacher/.cache \
    TRITON_CACHE_DIR=/home/teacher/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    TEACHER_SERVER_EXT_DIR=/opt/teacher-server/ext \
    TEACHER_SERVER_MODEL=/models \
    TEACHER_SERVER_HOST=0.0.0.0 \
    TEACHER_SERVER_PORT=8000

WORKDIR /home/teacher
USER 10001:10001

EXPOSE 8000

# Loading a large checkpoint takes minutes: failures during the start period don't count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TEACHER_SERVER_PORT', '8000'), timeout=4)"]

# SIGTERM (the default stop signal) goes straight to the server, which drains: new
# requests get 503, in-flight ones finish within TEACHER_SERVER_SHUTDOWN_TIMEOUT_S.
STOPSIGNAL SIGTERM
ENTRYPOINT ["teacher-server", "serve"]
