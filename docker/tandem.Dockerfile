# syntax=docker/dockerfile:1
# The model server: `tandem serve`, for both containers of a HybridModel pod (attention on the
# GPU, experts on the CPU socket) and for the embedded all-in-one role.
#
#   docker build -f docker/tandem.Dockerfile -t tandem:0.1.0 .                  # CUDA (default)
#   docker build -f docker/tandem.Dockerfile --target cpu -t tandem:0.1.0-cpu .  # CPU only
#
# Stages: `wheel` builds the tandem wheel; `cuda-venv` / `cpu-venv` install torch (first, pinned,
# so nothing pulls another build) and then the wheel into /opt/tandem; `cuda` / `cpu` copy that
# virtual environment onto a clean base and run as a non-root user.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
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
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# hadolint ignore=DL3013
RUN pip install --no-cache-dir /wheels/*.whl

FROM ${PYTHON_IMAGE} AS cpu-venv
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
RUN python -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# hadolint ignore=DL3013
RUN pip install --no-cache-dir /wheels/*.whl

FROM ${PYTHON_IMAGE} AS cpu
COPY --from=cpu-venv /opt/tandem /opt/tandem
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin tandem
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
USER 10001:10001
EXPOSE 50051 9400
ENTRYPOINT ["tandem"]
CMD ["serve", "--model", "/models", "--listen", "0.0.0.0:50051", "--metrics-port", "9400"]

FROM ${CUDA_IMAGE} AS cuda
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=cuda-venv /opt/tandem /opt/tandem
# Checkpoints come from the mounted volume; never reach for a model hub at run time.
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
# gRPC (contract.GRPC_PORT) and Prometheus metrics (contract.METRICS_PORT).
EXPOSE 50051 9400
ENTRYPOINT ["tandem"]
CMD ["serve", "--model", "/models", "--listen", "0.0.0.0:50051", "--metrics-port", "9400"]
