# syntax=docker/dockerfile:1
#
# teacher-server GPU image. Its name and tag are the Helm chart's default image,
# teacher-server:<version> (pyproject.toml's version, the chart's appVersion):
#
#   docker build -t teacher-server:0.1.0 .
#   docker run --gpus all -p 8000:8000 --shm-size 8g --stop-timeout 45 -v /path/to/Qwen3-32B:/models:ro teacher-server:0.1.0
#
# The checkpoint is never baked in: mount an HF checkpoint directory (config.json +
# safetensors) at /models, or mount a folder of checkpoints and point
# TEACHER_SERVER_MODEL at one of them (-e TEACHER_SERVER_MODEL=/models/Qwen3-32B), or name
# a hub id (-e TEACHER_SERVER_MODEL=Qwen/Qwen3-8B -e HF_TOKEN), fetched into
# $XDG_CACHE_HOME/huggingface/hub (mount a volume there to keep it across runs).
# Every setting is an environment variable TEACHER_SERVER_<FIELD> (TEACHER_SERVER_PORT,
# TEACHER_SERVER_API_KEY, ...), or a YAML file passed as `--config /path/config.yaml`
# after the image name. The root filesystem may be read-only: the process writes only
# to /tmp and $XDG_CACHE_HOME. --stop-timeout: the server drains for up to
# TEACHER_SERVER_SHUTDOWN_TIMEOUT_S (30) after SIGTERM; docker's default 10 s cuts it short.
#
# GPU architectures: TORCH_CUDA_ARCH_LIST, 8.0;8.6;8.9;9.0 (A100; A10/A40/RTX 30xx;
# L4/L40S/RTX 40xx; H100/H200). Our CUDA kernel is built for each of them at image build
# time (plus PTX of the newest, which newer GPUs JIT-compile); flash-attn for sm_80 (also
# runs on 8.6/8.9) and sm_90. A narrower list builds faster:
# --build-arg TORCH_CUDA_ARCH_LIST=9.0 --build-arg FLASH_ATTN_CUDA_ARCHS=90.
#
# The fast path at run time: the prebuilt kernel library (no CUDA toolkit in the final
# stage) and torch.compile/Triton, which compiles small C launchers with gcc against the
# Python headers, both present in the final stage.
#
# Build args: CUDA_VERSION / UBUNTU_VERSION pick the nvidia/cuda base images; TORCH_VERSION
# and TORCH_INDEX (the PyTorch wheel index matching CUDA 12.x) pick torch;
# FLASH_ATTN_VERSION and MAX_JOBS control the flash-attn source build.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04
# GPU architectures of the prebuilt kernel; the runtime stage keys its kernel cache on the
# same list, so both stages must see one value (this ARG).
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"

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

# One arch list for everything built here: torch's extension tooling reads
# TORCH_CUDA_ARCH_LIST, the kernel build and its cache key TEACHER_SERVER_CUDA_ARCH.
# flash-attn takes major families only: sm_80 code runs on 8.6 and 8.9.
ARG TORCH_CUDA_ARCH_LIST
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ENV TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
    TEACHER_SERVER_CUDA_ARCH="${TORCH_CUDA_ARCH_LIST}"

# Its own layer: the slowest step, kept cached when only the project's sources change.
RUN MAX_JOBS="${MAX_JOBS}" pip install --no-cache-dir --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"

WORKDIR /src
COPY . .

# The same install the tests exercise: the package with its `cuda` extra (which brings
# fla-core, the Triton kernels of the Qwen3.5 linear-attention layers; pure Python).
RUN pip install --no-cache-dir --no-build-isolation "/src[cuda]"

# cuDNN's Python frontend (the cudnn_fe attention backend) over the cuDNN that torch brings.
# Without its dependencies: they serve its CuTe DSL kernels (for CUDA 13), which this backend
# does not call; its SDPA graphs run on the cuDNN library alone.
ARG CUDNN_FRONTEND_VERSION=1.32.0
RUN pip install --no-cache-dir --no-deps "nvidia-cudnn-frontend==${CUDNN_FRONTEND_VERSION}"

# Build the CUDA kernel library now, for every arch in the list (no GPU needed, nvcc is
# here). Prebuilt rather than built at start: the runtime stage has no CUDA toolkit (a few
# GB), may mount its root filesystem read-only, and a pod should not spend minutes on
# nvcc before serving. It loads the cached library from TEACHER_SERVER_EXT_DIR, whose key
# (sources, flags, arch list, torch) matches because the runtime stage sets the same list.
ENV TEACHER_SERVER_EXT_DIR=/opt/teacher-server/ext
RUN mkdir -p "${TEACHER_SERVER_EXT_DIR}" \
    && python -m teacher_server.ops.gather_logprob

# ---------------------------------------------------------------------------------------
# runtime: CUDA runtime libraries, Python, and the C compiler Triton needs; no CUDA toolkit.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime

ARG APP_UID=10001
ARG TORCH_CUDA_ARCH_LIST
ARG VERSION=0.1.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

LABEL org.opencontainers.image.title="teacher-server" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="Teacher log-probs of student top-K candidates over HTTP (vLLM teacher-scoring compatible)"

# gcc + libc6-dev + python3.12-dev: torch.compile's Triton kernels are launched through a
# small C extension that Triton compiles on first use (cc -shared ... -I<Python.h dir>
# -lcuda); g++ for inductor's C++ code paths (host-side kernels of a compiled graph).
# See the note in the build stage on apt pinning.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-dev gcc g++ libc6-dev \
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
# Triton links its launchers with -lcuda. The driver's libcuda.so.1 comes from the host at
# run time, but an unversioned libcuda.so is not always there; linking against the
# toolkit's stub (soname libcuda.so.1) works on every host and loads the host's driver.
COPY --from=build /usr/local/cuda/lib64/stubs/libcuda.so /opt/teacher-server/libcuda-stub/libcuda.so

# Caches (triton, inductor, HF) live under XDG_CACHE_HOME and /tmp, the only paths that
# need to be writable; Kubernetes mounts emptyDirs there.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/teacher \
    XDG_CACHE_HOME=/home/teacher/.cache \
    TRITON_CACHE_DIR=/home/teacher/.cache/triton \
    TRITON_LIBCUDA_PATH=/opt/teacher-server/libcuda-stub \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    TEACHER_SERVER_EXT_DIR=/opt/teacher-server/ext \
    TEACHER_SERVER_CUDA_ARCH="${TORCH_CUDA_ARCH_LIST}" \
    TEACHER_SERVER_MODEL=/models \
    TEACHER_SERVER_HOST=0.0.0.0 \
    TEACHER_SERVER_PORT=8000

# Fail the build, not the first request, when Triton could not build a launcher here:
# the same compile and link it runs (a Python extension, -lcuda), on a probe source.
RUN printf '#include <Python.h>\nPyMODINIT_FUNC PyInit_probe(void) { return NULL; }\n' > /tmp/probe.c \
    && gcc /tmp/probe.c -O3 -shared -fPIC -o /tmp/probe.so -lcuda -L"${TRITON_LIBCUDA_PATH}" \
       -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    && rm /tmp/probe.c /tmp/probe.so

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
