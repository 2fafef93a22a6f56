# One image for every rollout-bus role (controller, executor, trainer, bus metrics).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, from the CPU index: the project's torch>=2.13 then finds it installed
# instead of pulling the CUDA wheels from PyPI.
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu

# The project (no .venv, .git or caches: only what the roles run).
COPY pyproject.toml README.md ./
COPY rollout_bus/ rollout_bus/
COPY events/ events/
COPY controller/ controller/
COPY executor/ executor/
COPY trainer/ trainer/
COPY engine/ engine/
COPY lm/ lm/
COPY tasks/ tasks/
COPY replay/ replay/
COPY launch/ launch/
COPY gateway/ gateway/
# EXTRA_PIP: more packages for a tools image, e.g. "rq-dashboard==0.9.0 six" (compose's rq-dashboard).
ARG EXTRA_PIP=""
RUN pip install . ${EXTRA_PIP} \
    && useradd --create-home --uid 10001 rollout \
    && mkdir -p /shared \
    && chown rollout /shared

USER rollout
# /metrics ports: bus 9100, controller 9101, executor 9102, trainer 9103
EXPOSE 9100 9101 9102 9103
CMD ["rollout-bus", "--help"]
