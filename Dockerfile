# miaohui's serving image: the serving runtime (no training framework) and a model repository of prebuilt engines.
# `make image` builds it with nothing from outside but the package archives (docs/deploy.md):
#   1. a base image: BASE_IMAGE, or debian:bookworm-slim made locally with debootstrap (scripts/image/base.sh);
#   2. the build context var/image/: wheels/ (the Python packages, filled beforehand with `pip wheel`) and
#      repository/ (the engines: built offline with `miaohui prepare`, or copied from a repository you name);
#   3. podman build -f Dockerfile var/image   (Docker elsewhere takes the same file and context).
# Inside the build, only apt reaches out (Debian's python3); pip installs from the wheelhouse with --no-index.
#
# VARIANT=gpu (documented, never built here): BASE_IMAGE a CUDA runtime image, a wheelhouse with CUDA torch, and the
# build extra (inductor engines compile their kernels at build time on the GPU node; see docs/deploy.md).
ARG BASE_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------- Python from the base image's distribution
FROM ${BASE_IMAGE} AS python
ARG VARIANT=cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# libgomp1: llama.cpp's OpenMP runtime. gpu: Triton (inductor's GPU kernels) compiles its kernel launchers with a C
# compiler when an engine loads
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libgomp1 \
    && if [ "$VARIANT" = "gpu" ]; then apt-get install -y --no-install-recommends gcc libc6-dev; fi \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc/* /usr/share/man/*

# ---------------------------------------------------------------- the serving virtualenv, from the wheelhouse only
FROM python AS venv
ARG VARIANT=cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY wheels /wheels
# cpu: the serve extra (ONNX Runtime + llama.cpp, no torch); gpu: + the build extra (torch for the inductor engines).
# pip byte-compiles what it installs (.pyc; keep it so: no --no-compile, no PYTHONDONTWRITEBYTECODE): a GPU server's
# start imports ~1,400 of torch's compiler modules, and compiling their source at every start cost 4.3 s on an H100.
# Shared libraries shipped with debug sections lose them (llama.cpp's wheel: 106 → 26 MB; libraries without them are
# left alone: stripping auditwheel-patched ones breaks them); pip and setuptools go.
# hadolint ignore=DL3008
RUN EXTRAS=serve; if [ "$VARIANT" = "gpu" ]; then EXTRAS=serve,build; fi; \
    apt-get update && apt-get install -y --no-install-recommends binutils && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-index --find-links /wheels --no-cache-dir --disable-pip-version-check \
      "miaohui[$EXTRAS]" \
    && find /opt/venv -name '*.so*' -type f -print0 \
      | while IFS= read -r -d '' lib; do if readelf -S "$lib" | grep -q '\.debug_info'; then strip --strip-debug "$lib"; fi; done \
    && /opt/venv/bin/pip uninstall -y --disable-pip-version-check setuptools pip

# ---------------------------------------------------------------- runtime
FROM python AS runtime
RUN groupadd --gid 10001 miaohui \
    && useradd --uid 10001 --gid 10001 --home-dir /var/miaohui --no-create-home --shell /usr/sbin/nologin miaohui
COPY --from=venv /opt/venv /opt/venv
# the models' layer, apart from the runtime's (docs/deploy.md reports both sizes)
COPY repository /opt/miaohui/repository
ENV PATH=/opt/venv/bin:$PATH \
    MIAOHUI_HOME=/var/miaohui \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/miaohui
EXPOSE 8000 8001
ENTRYPOINT ["miaohui"]
CMD ["serve", "--repository", "/opt/miaohui/repository", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "8001"]
