# syntax=docker/dockerfile:1
#
# Image for one node of a `distributed_training` job: PyTorch with CUDA from the official runtime image,
# this package on top, and docker/entrypoint.sh, which turns environment variables into a torchrun
# command (see that script for every variable it reads).
#
#   docker build -t distributed-training:0.1.0 .
#   docker run --rm --gpus all --read-only --tmpfs /tmp -v "$PWD/my.yaml:/config/config.yaml:ro" \
#       -v "$PWD/ckpt:/checkpoints" distributed-training:0.1.0 --set training.max_steps=100
#
# The working directory is the checkpoint volume, /checkpoints: a config with relative paths
# (`checkpoint.dir: checkpoints/run1`, `logging.dir: runs/run1`, as in examples/configs) writes onto the
# volume, which stays writable and persistent when the root filesystem is read-only (Kubernetes'
# readOnlyRootFilesystem, `docker run --read-only`). Relative logs land under /checkpoints/runs, where the
# TensorBoard sidecar and the liveness probe (DT_LOG_DIR) look.
#
# The base image's torch (2.11.0, CUDA 12.8: drivers >= 570) satisfies the package's `torch>=2.4`, so
# pip keeps it; the build fails if the torch left in the image has lost its CUDA build.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

LABEL org.opencontainers.image.title="distributed_training" \
      org.opencontainers.image.description="Data-parallel training (DDP, ZeRO, FSDP) on torch.distributed, launched by torchrun" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.base.name="docker.io/pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DT_CONFIG=/config/config.yaml \
    DT_CHECKPOINT_DIR=/checkpoints \
    DT_NNODES=1 \
    DT_MAX_RESTARTS=3 \
    DT_JOB_ID=dtrain

# A fixed, numeric non-root identity (Kubernetes' runAsUser/fsGroup use the same 1000). --non-unique
# keeps the build working on bases that already have a user or group with id 1000.
RUN groupadd --gid 1000 --non-unique dtrain \
    && useradd --uid 1000 --gid 1000 --non-unique --create-home --shell /bin/bash dtrain \
    && mkdir -p /config /checkpoints \
    && chown 1000:1000 /checkpoints

# The build context is what .dockerignore lets through: pyproject.toml, README.md, LICENSE, the
# package and docker/. Installed as a regular (non-editable) package; the sources are then removed.
COPY . /tmp/dtrain-src
RUN python -m pip install --no-cache-dir /tmp/dtrain-src \
    && python -c "import torch, distributed_training; assert torch.version.cuda, 'torch lost its CUDA build'" \
    && rm -rf /tmp/dtrain-src

COPY --chmod=0755 docker/entrypoint.sh docker/probe.sh /opt/dtrain/docker/

USER 1000:1000
# Declared a volume so that, with no -v for it, Docker still gives the job a writable (anonymous) one.
VOLUME ["/checkpoints"]
WORKDIR /checkpoints

# 6006: TensorBoard (a sidecar reading the job's logging.dir); 29400: torchrun's c10d rendezvous.
EXPOSE 6006 29400

# Healthy while torchrun runs (and its logs keep moving when DT_LOG_DIR and DT_STALL_SECONDS are set),
# or once the run is complete. Kubernetes ignores this and uses the probes in k8s/statefulset.yaml.
HEALTHCHECK --interval=60s --timeout=10s --start-period=120s --retries=3 \
    CMD ["/opt/dtrain/docker/probe.sh", "alive"]

ENTRYPOINT ["/opt/dtrain/docker/entrypoint.sh"]
