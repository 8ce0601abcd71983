# syntax=docker/dockerfile:1
# The model server: `tandem serve`, for both containers of a HybridModel pod (attention on the
# GPU, experts on the CPU socket) and for the embedded all-in-one role.
#
#   docker build -f docker/tandem.Dockerfile -t tandem:0.1.0 .                  # CUDA (default)
#   docker build -f docker/tandem.Dockerfile --target cpu -t tandem:0.1.0-cpu .  # CPU only
#
# Stages: `wheel` builds the tandem wheel; `cuda-venv` / `cpu-venv` install torch (first, pinned,
# so nothing pulls another build) and then the wheel into /opt/tandem, and build the native CPU
# expert kernel into /opt/tandem/kernels (a compiler there, none in the image); `cuda` / `cpu`
# copy that virtual environment onto a clean base and run as a non-root user. The kernel is
# imported from its built directory as it is, so the read-only root filesystem the operator
# gives the pods is no obstacle; the build stops the image build if it fails, rather than
# shipping an image whose experts quietly run on torch's slower kernels.

# Base images are pinned to a full version, so a rebuild gets the same interpreter; bump them
# deliberately, and pin a digest for production builds (--build-arg PYTHON_IMAGE=...@sha256:...).
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
# The CUDA runtime base; its Python (Ubuntu 24.04: 3.12) runs the virtual environment.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
# PyTorch's CPU-only wheels: the default index's Linux torch bundles CUDA (several GB).
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services/ services/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${CUDA_IMAGE} AS cuda-venv
ARG TORCH_VERSION
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH \
    TANDEM_EXPERTS_KERNEL_DIR=/opt/tandem/kernels
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# hadolint ignore=DL3013
RUN pip install --no-cache-dir /wheels/*.whl \
 && python -m tandem.experts.build --require

FROM ${PYTHON_IMAGE} AS cpu-venv
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH \
    TANDEM_EXPERTS_KERNEL_DIR=/opt/tandem/kernels
RUN pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# hadolint ignore=DL3013
RUN pip install --no-cache-dir /wheels/*.whl \
 && python -m tandem.experts.build --require

FROM ${PYTHON_IMAGE} AS cpu
# The kernel's OpenMP runtime (the compiler's, which the image does not carry).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=cpu-venv /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH \
    TANDEM_EXPERTS_KERNEL_DIR=/opt/tandem/kernels \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
# The user the operator runs the model pods as (tandem_operator.pod.NONROOT_ID).
USER 65532:65532
EXPOSE 50051 9400
ENTRYPOINT ["tandem"]
CMD ["serve", "--model", "/models", "--listen", "0.0.0.0:50051", "--metrics-port", "9400"]

FROM ${CUDA_IMAGE} AS cuda
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=cuda-venv /opt/tandem /opt/tandem
# Checkpoints come from the mounted volume; never reach for a model hub at run time.
ENV PATH=/opt/tandem/bin:$PATH \
    TANDEM_EXPERTS_KERNEL_DIR=/opt/tandem/kernels \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# The user the operator runs the model pods as (tandem_operator.pod.NONROOT_ID).
USER 65532:65532
# gRPC (contract.GRPC_PORT) and Prometheus metrics (contract.METRICS_PORT).
EXPOSE 50051 9400
ENTRYPOINT ["tandem"]
CMD ["serve", "--model", "/models", "--listen", "0.0.0.0:50051", "--metrics-port", "9400"]
