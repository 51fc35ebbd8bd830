# Two commands set everything up from a clean clone: `make run` (the default job) and `make test` (the test suite).
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test fault-ci soak bench clean

# Pinned dependencies from requirements.lock, then the project itself (editable, so conf/ edits apply at once).
$(STAMP): pyproject.toml requirements.lock
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/ftlab

test: setup
	$(PYTHON) -m pytest

# A node killed mid-run under every policy with every protection (conf/policy x conf/protection), with its invariants.
fault-ci: setup
	$(PYTHON) -m ftlab.experiments.fault_ci

# Seeded random fault scenarios checked against their fault-free twins: make soak N=200 SEED=7 (SEED: today's date).
N ?= 10
soak: setup
	$(PYTHON) -m ftlab.experiments.soak --scenarios $(N) $(if $(SEED),--seed $(SEED))

bench: setup
	$(PYTHON) -m ftlab.experiments.bench_runtime
	$(PYTHON) -m ftlab.experiments.bench_planner
	$(PYTHON) -m ftlab.experiments.bench_recovery

clean:
	rm -rf $(VENV) .ftlab outputs multirun mlflow.db mlruns
