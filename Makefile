# The two README commands (`make demo`, `make test`) and their helpers. Everything installs into
# .venv with pip: `pip install torch==2.13.0` takes the machine's local CPU wheel, and every torch
# requirement in this repo is a range that 2.13.0 satisfies, so nothing pulls CUDA builds.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
ENGINE  ?= reference
STEPS   ?= 5
PYTEST_ARGS ?=
STAMP   := $(VENV)/.installed

.PHONY: venv demo test test-core test-plugins test-e2e bench clean

venv: $(STAMP)

$(STAMP): requirements-dev.txt core/pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

demo: venv
	$(BIN)/weightsync demo --engine $(ENGINE) --steps $(STEPS)

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-core: venv
	$(BIN)/python -m pytest core/tests $(PYTEST_ARGS)

test-plugins: venv
	$(BIN)/python -m pytest plugins $(PYTEST_ARGS)

test-e2e: venv
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

bench: venv
	$(BIN)/weightsync bench --json benchmarks/results/bench.json --png benchmarks/results/bench.png

clean:
	rm -rf $(VENV)
