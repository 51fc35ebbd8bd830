"""ftlab's experiment as MLflow's UI opens it: the addresses ftlab prints open the model-training navigation, the
runs table without a banner, and the key figures as a saved view of the experiment (``runtime.reporting.tracking``).
The pages themselves are checked in a browser by ``tests/test_ui.py``."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

from mlflow.tracking import MlflowClient

from ftlab.runtime.reporting.tracking import (
    KEY_FIGURES, VIEW_KEY, VIEW_NAME, compare_url, ensure_experiment, figures_url, view_url,
)

SERVER = "http://127.0.0.1:5000"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
SEARCH_FACETS = {"searchFilter", "orderByKey", "orderByAsc", "startTime", "lifecycleFilter", "modelVersionFilter",
                 "datasetsFilter"}  # fmt: skip
"""The runs page's own address parameters: with any of them in the address the UI does not load a shared view."""


def query(url: str) -> dict[str, list[str]]:
    """The parameters of an address of MLflow's UI (they follow the ``#``: the UI routes in the fragment)."""
    return urllib.parse.parse_qs(urllib.parse.urlsplit(url.split("#", 1)[1]).query)


def test_every_address_opens_the_model_training_navigation() -> None:
    for url in (view_url(SERVER, "7"), figures_url(SERVER, "7"), compare_url(SERVER, "7", ["a", "b"])):
        assert query(url)["workflowType"] == ["machine_learning"], url


def test_the_runs_table_opens_sorted_by_goodput_without_a_shared_view() -> None:
    url = view_url(SERVER, "7")
    assert url.startswith(f"{SERVER}/#/experiments/7/runs?")
    params = query(url)
    assert "viewStateShareKey" not in params  # no shared view: no banner over the table
    assert params["orderByKey"] == [f"metrics.`{KEY_FIGURES[0]}`"] and params["orderByAsc"] == ["false"]


def test_the_key_figures_address_opens_the_saved_view() -> None:
    params = query(figures_url(SERVER, "7"))
    assert params["viewStateShareKey"] == [VIEW_KEY]
    assert not SEARCH_FACETS & params.keys()


def test_the_experiment_holds_its_kind_and_the_key_figures_as_a_named_saved_view(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment_id = ensure_experiment(client, "ftlab", uri)
    tags = client.get_experiment(experiment_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(tags[VIEW_TAG])  # the envelope the UI's "Save view" writes, listed in its "Views" menu
    assert view["name"] == VIEW_NAME and isinstance(view["createdAt"], int) and view["updatedAt"] == view["createdAt"]
    state = json.loads(view["state"])
    assert state["selectedColumns"][: len(KEY_FIGURES)] == [f"metrics.`{name}`" for name in KEY_FIGURES]
    assert state["orderByKey"] == f"metrics.`{KEY_FIGURES[0]}`" and state["orderByAsc"] is False

    assert ensure_experiment(client, "ftlab", uri) == experiment_id
    assert client.get_experiment(experiment_id).tags[VIEW_TAG] == tags[VIEW_TAG], "an unchanged view keeps its times"

    client.set_experiment_tag(experiment_id, VIEW_TAG, view["state"])  # the bare state an older ftlab stored
    ensure_experiment(client, "ftlab", uri)
    assert json.loads(client.get_experiment(experiment_id).tags[VIEW_TAG])["name"] == VIEW_NAME
