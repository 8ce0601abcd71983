# syntax=docker/dockerfile:1
# The operator: kopf and the Kubernetes client, no torch. It imports only tandem.contract from
# the tandem distribution, so that is installed with --no-deps next to the operator's own
# dependencies (pinned as in pyproject.toml; tests/chart checks they agree).
#
#   docker build -f docker/operator.Dockerfile -t tandem-operator:0.1.0 .

# Base images are pinned to a full version, so a rebuild gets the same interpreter; bump them
# deliberately, and pin a digest for production builds (--build-arg PYTHON_IMAGE=...@sha256:...).
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS venv
RUN python -m venv /opt/operator
ENV PATH=/opt/operator/bin:$PATH
RUN pip install --no-cache-dir \
      kopf==1.45.2 \
      kubernetes==37.0.2 \
      prometheus-client==0.26.0 \
      aiohttp==3.14.5 \
      pyyaml==6.0.3
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services/ services/
COPY operator/ operator/
RUN pip install --no-cache-dir --no-deps . \
 && python -c "import sys, tandem_operator, tandem.contract; assert 'torch' not in sys.modules"

FROM ${PYTHON_IMAGE}
COPY --from=venv /opt/operator /opt/operator
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin tandem
ENV PATH=/opt/operator/bin:$PATH \
    PYTHONUNBUFFERED=1
# The chart's operator.podSecurityContext.runAsUser and runAsGroup.
USER 10001:10001
# kopf's liveness endpoint (the chart's operator.healthPort).
EXPOSE 8080
# `tandem-operator` is `kopf run --module=tandem_operator`; the chart passes its own arguments.
ENTRYPOINT ["tandem-operator"]
CMD ["--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
