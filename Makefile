# rankserve: `make run` sets up and runs the service demo on the bundled model; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup run test test-fast redis clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0  # the CPU build; a bare `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q -e '.[serve,triton,bench,dev]'
	touch $@

redis:
	@bash scripts/ensure_redis.sh

# -P: the repo root stays off sys.path. Its top-level folders (kernels/, workers/, ...) are this package's
# sources, mapped to rankserve.*; on sys.path, kernels/ would shadow the PyPI `kernels` that transformers >= 5.25
# imports.
run: setup redis
	$(BIN)/python -P -m rankserve.deployments.demo

test: setup redis
	$(BIN)/python -P -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -P -m pytest -q -m "not serve and not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info
