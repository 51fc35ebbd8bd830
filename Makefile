# Two commands set everything up from a clean clone: `make run` (the default job) and `make test` (the test suite).
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test fault-ci bench clean

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

# A short fault-injection scenario (a node killed mid-run) for every policy in conf/policy, with its invariants.
fault-ci: setup
	$(PYTHON) -m experiments.fault_ci

bench: setup
	$(PYTHON) -m experiments.bench_runtime
	$(PYTHON) -m experiments.bench_planner
	$(PYTHON) -m experiments.bench_recovery
	$(PYTHON) -m experiments.bench_snapshots

clean:
	rm -rf $(VENV) .ftlab outputs multirun mlflow.db mlruns
