"""Shared fixtures: every job a test runs gets its own MLflow store and checkpoint directory, and one token cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistryStore
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as TrackingStore

from ftlab.runtime.training.data import tokenize_corpus
from ftlab.experiments.job import JobResult, compose_config, run_job


@pytest.fixture(autouse=True)
def release_mlflow_connections() -> Iterator[None]:
    """Close the pooled database connections of every MLflow store the test opened.

    MLflow keeps one SQLAlchemy engine per store URI for the life of the process. A job run once per process (or a
    sweep writing to one store) holds one; this suite gives every test its own store, so the pytest process would
    gather their open connections until it passes the 1,024 file descriptors ``select()`` accepts (Pyomo's output
    capture then fails). A disposed engine stays usable: it reconnects when next asked.
    """
    yield
    for store in (TrackingStore, RegistryStore):
        for engine in store._engine_map.values():  # MLflow offers no public handle on this cache
            engine.dispose()


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("tokens")
    tokenize_corpus(None, 8192, cache)  # the default model's vocabulary: tokenised once per session
    return cache


@pytest.fixture
def job_overrides(tmp_path: Path, token_cache: Path) -> list[str]:
    return [
        "experiment=plain",  # the groups' defaults, not the quick-start preset
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"train.cache_dir={token_cache}",
        f"train.checkpoint_dir={tmp_path}/checkpoints",
        "progress=false",
    ]


@pytest.fixture
def run(job_overrides: list[str]):  # noqa: ANN201 - a callable running one job
    def run_with(*overrides: str) -> JobResult:
        return run_job(compose_config([*job_overrides, *overrides]))

    return run_with
