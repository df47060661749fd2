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
# PID 1 is tini (no `docker run --init` needed): it forwards SIGTERM to the server and reaps
# the engine and worker processes the server starts, should one outlive it.
# Compiled kernels and autotuning results go to $XDG_CACHE_HOME/teacher-server/compile (or
# TEACHER_SERVER_COMPILE_CACHE_DIR): mount a volume there (-v ts-compile:/home/teacher/.cache)
# and a restart skips those compiles (docs/deploy.md).
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
# Versions: requirements.lock (the one lock, which the GPU benchmark runs install too) pins
# torch 2.11.0 (from the PyTorch CUDA 13.0 index, TORCH_INDEX=cu130), flash-attn, fla-core,
# the cuDNN frontend and every server dependency; the base images are pinned by tag and by
# digest (CUDA_DEVEL_DIGEST / CUDA_RUNTIME_DIGEST: the multi-platform index digests of
# nvidia/cuda:13.0.1-{devel,runtime}-ubuntu24.04; another CUDA_VERSION needs the digests of its
# tags, from `docker buildx imagetools inspect nvidia/cuda:<tag>`). MAX_JOBS bounds the
# flash-attn source build.

ARG CUDA_VERSION=13.0.1
ARG UBUNTU_VERSION=24.04
ARG CUDA_DEVEL_DIGEST=sha256:7d2f6a8c2071d911524f95061a0db363e24d27aa51ec831fcccf9e76eb72bc92
ARG CUDA_RUNTIME_DIGEST=sha256:c3fde347d52d578c84fd644bc177bc7ec333feaf11550d990da4084d7612e4c7
# GPU architectures of the prebuilt kernel; the runtime stage keys its kernel cache on the
# same list, so both stages must see one value (this ARG).
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"

# ---------------------------------------------------------------------------------------
# build: compilers + CUDA toolkit; produces /opt/venv and the prebuilt kernel extension.
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION}@${CUDA_DEVEL_DIGEST} AS build

ARG TORCH_INDEX=cu130
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

# torch first, the lock's version from the CUDA wheel index, so the later installs keep this
# build; then the build tools flash-attn needs (its setup.py imports torch: --no-build-isolation).
COPY requirements.lock /src/requirements.lock
RUN pip install --no-cache-dir "torch==$(sed -n 's/^torch==//p' /src/requirements.lock)" \
        --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}" \
    && pip install --no-cache-dir setuptools==80.9.0 wheel==0.45.1 psutil==7.1.0 \
        "$(grep -E '^packaging==' /src/requirements.lock)" \
        "$(grep -E '^ninja==' /src/requirements.lock)"

# One arch list for everything built here: torch's extension tooling reads
# TORCH_CUDA_ARCH_LIST, the kernel build and its cache key TEACHER_SERVER_CUDA_ARCH.
# flash-attn takes major families only: sm_80 code runs on 8.6 and 8.9.
ARG TORCH_CUDA_ARCH_LIST
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ENV TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
    TEACHER_SERVER_CUDA_ARCH="${TORCH_CUDA_ARCH_LIST}"

# Its own layer: the slowest step, kept cached when only the project's sources change.
RUN MAX_JOBS="${MAX_JOBS}" pip install --no-cache-dir --no-build-isolation \
        "$(grep -E '^flash-attn==' /src/requirements.lock)"

# Everything else at the lock's versions, without resolving: the lock is the whole set (torch
# and flash-attn, installed above, already match it). This includes fla-core (the Triton
# kernels of the Qwen3.5 linear-attention layers) and cuDNN's Python frontend (the cudnn_fe
# attention backend), whose own dependencies serve its CuTe DSL kernels, which it does not call.
RUN pip install --no-cache-dir --no-deps -r /src/requirements.lock

WORKDIR /src
COPY . .

# The same install the tests exercise: the package with its `cuda` extra, whose requirements
# the lock holds (--no-deps: nothing beyond the lock comes in); then pip checks that the lock
# is complete and consistent (the cuDNN frontend's CuTe DSL dependencies excepted, see above).
RUN pip install --no-cache-dir --no-deps --no-build-isolation "/src[cuda]" \
    && problems="$(pip check 2>&1 | grep -v -e '^nvidia-cudnn-frontend ' -e '^No broken requirements' || true)" \
    && { [ -z "$problems" ] || { echo "requirements.lock is incomplete: $problems"; exit 1; }; }

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
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}@${CUDA_RUNTIME_DIGEST} AS runtime

ARG APP_UID=10001
ARG TORCH_CUDA_ARCH_LIST
ARG VERSION=0.1.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

LABEL org.opencontainers.image.title="teacher-server" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="Teacher log-probs of student top-K candidates over HTTP (vLLM teacher-scoring compatible)"

# gcc + libc6-dev + python3.12-dev: torch.compile's Triton kernels are launched through a
# small C extension that Triton compiles on first use (cc -shared ... -I<Python.h dir>
# -lcuda); g++ for inductor's C++ code paths (host-side kernels of a compiled graph). tini:
# the init process (PID 1). See the note in the build stage on apt pinning.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-dev gcc g++ libc6-dev tini \
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

# Caches live under XDG_CACHE_HOME and /tmp, the only paths that need to be writable (the
# compile cache too, unless TEACHER_SERVER_COMPILE_CACHE_DIR points elsewhere: the chart mounts
# a volume of its own there); Kubernetes mounts emptyDirs there.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/teacher \
    XDG_CACHE_HOME=/home/teacher/.cache \
    TRITON_LIBCUDA_PATH=/opt/teacher-server/libcuda-stub \
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

# SIGTERM (the default stop signal) goes to tini, which passes it to the server, which drains:
# new requests get 503, in-flight ones finish within TEACHER_SERVER_SHUTDOWN_TIMEOUT_S. tini
# also reaps any child that outlives its parent (a PID 1 that is the server would leave zombies).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "teacher-server", "serve"]
