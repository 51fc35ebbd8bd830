"""The MLflow UI shows what the README promises, checked in a real browser (``make ui-test``, marker ``ui``).

A small sweep fills a fresh store; the MLflow server serves it on the loopback interface at a free port; headless
Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by Selenium with the driver named: nothing is
downloaded) opens the addresses the sweep prints. Each page is in MLflow's model-training navigation (its sidebar
offers the model registry, not GenAI's judges) and lists the sweep's child runs: the experiment's runs table sorted by
goodput with no shared-view banner over it, the key figures' saved view (named in the table's "Views" menu) with
each job's ``summary/goodput_ratio``, and the compare view with that metric. The screenshots are kept in
``$FTLAB_UI_ARTIFACTS`` (default ``ui-artifacts/``) and on the sweep's parent run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.runtime.reporting.tracking import KEY_FIGURES, VIEW_NAME, compare_url, figures_url, view_url
from tests.test_sweep import ftlab, sweep_runs

pytestmark = pytest.mark.ui

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("FTLAB_UI_ARTIFACTS", "ui-artifacts"))
PAGE_TIMEOUT_S = 90
SHARED_VIEW_BANNER = "You're viewing a shared view"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """``mlflow server`` on the test's store, 127.0.0.1 only, one worker; stopped (its process group) afterwards.
    The server keeps its job queue in a directory it makes under /dev/shm and never removes: removed here."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", f"sqlite:///{tmp_path}/mlflow.db",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = open(tmp_path / "mlflow-server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the MLflow server did not answer in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
        log.close()
        for made in (set(shm.iterdir()) if shm.is_dir() else set()) - before:
            if made.is_dir() and any(made.glob("*.mlflow-huey-store")):
                shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def browser():  # noqa: ANN201 - a selenium WebDriver
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1400"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for_text(driver, texts: list[str], screenshot: Path) -> str:  # noqa: ANN001
    """The page's text once it holds every one of ``texts`` (the UI renders after its API calls)."""
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while True:
        body = driver.find_element("tag name", "body").text
        missing = [t for t in texts if t not in body]
        if not missing or time.monotonic() > deadline:
            time.sleep(1.0)  # let the last cells paint before the picture
            driver.save_screenshot(str(screenshot))
            assert not missing, f"{missing} not on the page after {PAGE_TIMEOUT_S} s; see {screenshot}"
            return body
        time.sleep(1.0)


def assert_model_training(driver, body: str) -> None:  # noqa: ANN001
    """The page is in the model-training navigation: the address says so, and the sidebar has the model registry
    and none of GenAI's pages."""
    assert "workflowType=machine_learning" in driver.current_url, driver.current_url
    assert "Model registry" in body and "Judges" not in body and "Prompts & versions" not in body, body[:1500]


def test_the_mlflow_ui_lists_the_sweeps_runs_with_their_goodput(
    tmp_path: Path, token_cache: Path, mlflow_server: str, browser  # noqa: ANN001
) -> None:
    done = ftlab(tmp_path, token_cache, "-m", "cluster.nodes=2", "train.steps=3", "faults.seed=0,1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client, parent, children = sweep_runs(tmp_path)
    experiment_id = parent.info.experiment_id
    names = sorted(r.info.run_name for r in children)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    # The experiment's runs table, best goodput first, with no banner over it.
    browser.get(view_url(mlflow_server, experiment_id))
    runs = [*names, parent.info.run_name]
    table = wait_for_text(browser, [*runs, f"Sort: {KEY_FIGURES[0]}"], ARTIFACTS / "runs-table.png")
    assert_model_training(browser, table)
    assert SHARED_VIEW_BANNER not in table

    # The key figures as columns: ftlab's saved view, by its name in the Views menu, with each job's goodput.
    browser.get(figures_url(mlflow_server, experiment_id))
    figures = wait_for_text(browser, [*runs, "summary/goodput_ratio"], ARTIFACTS / "key-figures.png")
    goodputs = [repr(r.data.metrics["summary/goodput_ratio"])[:6] for r in children]
    assert all(g in figures for g in goodputs), (goodputs, figures[:3000])
    assert browser.find_element("css selector", "[data-testid='saved-views-trigger']").text == VIEW_NAME
    assert_model_training(browser, figures)

    # MLflow's compare view of the sweep's jobs: parameters that differ, then every metric.
    browser.get(compare_url(mlflow_server, experiment_id, [r.info.run_id for r in children]))
    assert_model_training(browser, wait_for_text(browser, [*names, "Show diff only"], ARTIFACTS / "compare-runs.png"))
    browser.find_element("xpath", "//*[text()='Visualizations']").click()  # folded: the tables move up
    for switch in browser.find_elements("xpath", "//*[text()='Show diff only']")[:2]:
        switch.click()  # only the parameters and metrics that differ: the metrics table shows a few rows at a time
    metrics = browser.find_element("xpath", "//*[text()='Metrics']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'})", metrics)
    wait_for_text(browser, [*names, "summary/goodput_ratio"], ARTIFACTS / "compare-runs.png")

    for picture in ("compare-runs.png", "runs-table.png", "key-figures.png"):
        client.log_artifact(parent.info.run_id, str(ARTIFACTS / picture), "ui")
