# syntax=docker/dockerfile:1
#
# The qgpu image: one Python package runs every qgpu process of the Helm chart (helm/qgpu):
# qgpu-manager's node agent (`qgpu agent`) and device plugin (`qgpu device-plugin`) and its
# install-interposer / label-node init containers, and qgpu-scheduler's extender
# (`qgpu extender`) and webhook (`qgpu webhook`).
#
#   docker build -t <registry>/qgpu:0.1.0 .
#
# qgpu-scheduler's kube-scheduler is the STOCK image (registry.k8s.io/kube-scheduler, the
# chart's scheduler.kubeScheduler.image), unchanged: it reads the chart's
# KubeSchedulerConfiguration from a ConfigMap and calls the extender container next to it,
# so there is no scheduler image to build. Ray and Dask are not installed (extra [k8s] only).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: compile the interposer and the simulated driver with the system C compiler ----
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN python -m venv /opt/qgpu \
    && /opt/qgpu/bin/pip install --no-cache-dir ".[k8s]" \
    && /opt/qgpu/bin/python -c "from enforcement.native import hook_library_path, sim_library_dir; print(hook_library_path(), sim_library_dir())" \
    && /opt/qgpu/bin/qgpu device-plugin --help > /dev/null

# --- qgpu: the runtime image, no compiler ---------------------------------------------------
FROM ${PYTHON_IMAGE} AS qgpu
COPY --from=build /opt/qgpu /opt/qgpu
ENV PATH=/opt/qgpu/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# The chart runs qgpu-manager as root (privileged: NVML, /dev/nvidia*, root-owned limits
# files) and qgpu-scheduler's containers as uid 65532; everything here is world-readable.
CMD ["qgpu", "--help"]
