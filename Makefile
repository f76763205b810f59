# miaohui — two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
GRPC_PORT ?= 8001
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: install run prepare test test-fast lint format bench docs clean promtool browser redis image image-test

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

## Build the default engines if missing (trains the intent model on first run), then serve.
run: $(STAMP)
	$(BIN)/miaohui prepare
	$(BIN)/miaohui serve --host $(HOST) --port $(PORT) --grpc-port $(GRPC_PORT)

prepare: $(STAMP)
	$(BIN)/miaohui prepare

## promtool (Debian `prometheus`) for the alert-rule tests in deploy/; idempotent
promtool:
	@bash scripts/install_prometheus.sh || echo "warning: promtool not installed; the Prometheus rule tests will skip"

## redis-server (Debian) for the shared session store's tests; idempotent
redis:
	@bash scripts/install_redis.sh || echo "warning: redis-server not installed; the Redis session store tests will skip"

## Headless Chromium + chromedriver (Debian) for the web console's browser test; idempotent
browser:
	@bash scripts/install_browser.sh || echo "warning: chromium not installed; the console's browser test will skip"

## The CPU test suite (what CI runs). Real models, real engines, real servers on localhost. Test files are spread
## over TEST_WORKERS pytest-xdist processes (a file's tests stay in one) in the order tests/conftest.py gives them
## (slow files first, those needing the intent model it trains in the background last); TEST_WORKERS=0 runs them in
## this process.
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP) promtool browser redis
	$(BIN)/pytest $(XDIST) $(PYTEST_ARGS)

## Quick loop while developing: skips the tests marked slow.
test-fast: $(STAMP)
	$(BIN)/pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts lab
	$(BIN)/ruff format --check src tests benchmarks scripts lab
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks scripts lab
	$(BIN)/ruff format src tests benchmarks scripts lab

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_intent_cpu.py

## docs/model-repository.md from the config docstrings (tests/unit/test_config_docs.py fails when it is stale).
docs: $(STAMP)
	$(BIN)/python scripts/gen_config_docs.py

## The CPU serving image (podman; Docker with ENGINE=docker): a local Debian base, a wheelhouse, the engines of
## REPOSITORY (default: `miaohui prepare`'s). Nothing from outside but the package archives. See docs/deploy.md.
image: $(STAMP)
	VENV=$(VENV) bash scripts/image/build.sh

## Build a small image (tiny intent model + SmolLM2 GGUF) and check it: read-only, non-root, ready, /v1/intent, a
## streamed chat, /metrics, SIGTERM drains. IMAGE=miaohui:0.1.0-cpu checks the image `make image` built instead.
image-test: $(STAMP)
	$(BIN)/pytest -p no:xdist tests/e2e/test_image.py -s $(PYTEST_ARGS)

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
