# Two commands set everything up from a clean clone: `make run` (the default job) and `make test` (the test suite).
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test ui-test gpu-test sweep fault-ci soak bench clean

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

# The MLflow UI in headless Chromium (Debian's chromium and chromium-driver: apt-get install chromium chromium-driver):
# a small sweep, the MLflow server on its store, the runs table and the compare view. Screenshots: ui-artifacts/.
# Tests behind the slow marker: more phases, the ssh and SLURM launchers, a soak slice (pyproject.toml says which).
test-slow: setup
	$(PYTHON) -m pytest -m slow

ui-test: setup
	$(PYTHON) -m pytest -m ui tests/test_ui.py

# The NCCL path on a machine with CUDA (each worker on its own GPU); the tests skip themselves without one.
gpu-test: setup
	$(PYTHON) -m pytest -m gpu tests/test_gpu.py

# A small sweep of policies x failure rates (Oobleck and checkpoint-restart, both with storage checkpoints, on the
# quick-start cluster; exponential node faults every 8 or 16 steps on average). It leaves the comparison figure in
# multirun/make-sweep/ftlab-sweep/comparison.png and on the sweep's MLflow run (store: sweep.db).
SWEEP_DIR := multirun/make-sweep
sweep: setup
	rm -rf $(SWEEP_DIR)
	$(VENV)/bin/ftlab -m experiment=quickstart policy=oobleck,checkpoint_restart protection=storage \
		faults=exponential faults.mtbf_steps=8,16 tracking.uri=sqlite:///sweep.db hydra.sweep.dir=$(SWEEP_DIR)

# A node killed mid-run under every policy with every protection (conf/policy x conf/protection), with its invariants.
fault-ci: setup
	$(PYTHON) -m ftlab.experiments.fault_ci

# Seeded random fault scenarios checked against their fault-free twins: make soak N=200 SEED=7 (SEED: today's date).
# FIRST=100 carries a campaign on from scenario 100.
N ?= 10
soak: setup
	$(PYTHON) -m ftlab.experiments.soak --scenarios $(N) $(if $(SEED),--seed $(SEED)) $(if $(FIRST),--first $(FIRST))

bench: setup
	$(PYTHON) -m ftlab.experiments.bench_runtime
	$(PYTHON) -m ftlab.experiments.bench_planner
	$(PYTHON) -m ftlab.experiments.bench_recovery
	$(PYTHON) -m ftlab.experiments.bench_policies
	$(PYTHON) -m ftlab.experiments.bench_staggered
	$(PYTHON) -m ftlab.experiments.bench_snapshots
	$(PYTHON) -m ftlab.experiments.bench_simulator

clean:
	rm -rf $(VENV) .ftlab outputs multirun mlflow.db sweep.db mlruns mlartifacts ui-artifacts
