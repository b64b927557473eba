"""The dashboards as a user sees them: `opentinker train` through the stack, then the Prefect and MLflow UIs
opened in headless Chromium (Debian's ``chromium`` + ``chromium-driver``, installed by install.sh).

Screenshots of every page checked go to ``$OPENTINKER_SCREENSHOT_DIR`` (default: the test's tmp dir);
``docs/screenshots/`` holds a committed set from such a run (README, "Where to look").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import httpx
import mlflow
import pytest
from fixtures.server import wait_for_job

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
WAIT_S = 90
CONFIG = """\
env_id = "CartPole-v1"
steps = 4096
seed = 1
num_envs = 4
workers = 2
eval_episodes = 3
champion_threshold = 0.0
run_name = "browser-run"
model_name = "browser-cartpole"
experiment = "dashboards"
[ppo]
n_steps = 128
"""


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through the system chromedriver; Selenium Manager stays offline (nothing downloaded)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("chromium and chromium-driver are missing: run ./install.sh as root (or apt-get install them)")
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def trained_through_the_stack(s3_server, mlflow_server, prefect_server, tmp_path_factory):
    """`opentinker train` as a user runs it with the stack's variables: (stdout, MLflow run, flow run id)."""
    root = tmp_path_factory.mktemp("dashboards")
    (root / "train.toml").write_text(CONFIG)
    env = {
        **os.environ,
        "OPENTINKER_DATA_DIR": str(root / "data"),
        "COLUMNS": "200",
        "OPENTINKER_MLFLOW_TRACKING_URI": mlflow_server,
        "OPENTINKER_PREFECT_API_URL": prefect_server,
        "PREFECT_API_URL": prefect_server,
        "OPENTINKER_S3_ENDPOINT_URL": s3_server.endpoint_url,
        "OPENTINKER_S3_ACCESS_KEY": s3_server.access_key,
        "OPENTINKER_S3_SECRET_KEY": s3_server.secret_key,
        "OPENTINKER_S3_BUCKET": s3_server.bucket,
    }
    train = subprocess.run(
        [str(Path(sys.executable).parent / "opentinker"), "train", "CartPole-v1", "--config", str(root / "train.toml")],
        env=env,
        cwd=root,
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stdout + train.stderr
    run_id = re.search(r"MLflow run: (\w+)", train.stdout)[1]
    run = mlflow.MlflowClient(mlflow_server).get_run(run_id)
    return train.stdout, run, run.data.tags["prefect.flow_run_id"]


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    directory = Path(os.environ.get("OPENTINKER_SCREENSHOT_DIR") or tmp_path_factory.mktemp("screenshots"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _open(driver, url: str, *texts: str) -> str:
    """Load ``url`` and wait until the page shows every one of ``texts``; returns the page's visible text."""
    driver.get(url)
    return _wait_for(driver, *texts)


def _wait_for(driver, *texts: str) -> str:
    """Wait on the page already open until it shows every one of ``texts`` (a single-page app renders late)."""
    from selenium.webdriver.support.ui import WebDriverWait

    body = ""

    def shows_all(d) -> bool:
        nonlocal body
        body = d.find_element("tag name", "body").text
        return all(text in body for text in texts)

    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(shows_all)
    except Exception:
        missing = [text for text in texts if text not in body]
        raise AssertionError(f"{driver.current_url} never showed {missing}; it showed:\n{body[:3000]}") from None
    return body


def _close_mlflow_overlays(driver) -> None:
    """MLflow 3.17 opens its chat panel over a third of the page on first visit, and the registry its "new model
    registry UI" announcement over the list: close the dialog first (it takes every click), then the panel."""
    from selenium.webdriver.support.ui import WebDriverWait

    def no_dialog_shown(d) -> bool:
        return not any(dialog.is_displayed() for dialog in d.find_elements("css selector", "[role='dialog']"))

    for selector in ("[role='dialog'] button[aria-label='Close']", "button[aria-label='Close']"):
        for button in driver.find_elements("css selector", selector):
            if button.is_displayed():
                button.click()
        # A closed dialog animates out while still displayed (its button then has zero size and refuses a click):
        # wait until it is gone before looking for the panel's button, which the same selector would also match.
        WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(no_dialog_shown)


def _wait_for_image(driver, other_than: str = "") -> None:
    """Wait until the artifact viewer has drawn its image (fetched as a blob, decoded late), a new one when the
    previous image's ``other_than`` blob URL is given."""
    from selenium.webdriver.support.ui import WebDriverWait

    def drawn(d) -> bool:
        images = [
            i for i in d.find_elements("css selector", "img[src^='blob:']") if i.get_attribute("src") != other_than
        ]
        return bool(images) and int(images[0].get_attribute("naturalWidth") or 0) > 100

    WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(drawn)


def _click_tab(driver, name: str) -> None:
    driver.find_element("xpath", f"//li[contains(@class, 'p-tab') and normalize-space()='{name}']").click()


def _task_runs(api_url: str, flow_run_id: str) -> dict[str, str]:
    """Task name (without Prefect's ``-abc`` suffix) → task run id, from the server's API."""
    body = json.dumps({"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 50}).encode()
    request = urllib.request.Request(
        f"{api_url}/task_runs/filter", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return {run["name"].rsplit("-", 1)[0]: run["id"] for run in json.load(response)}


def test_the_cli_prints_links_to_the_ml_views_once(trained_through_the_stack, mlflow_server):
    stdout, run, _ = trained_through_the_stack
    assert "View run" not in stdout and "opentinker stack up" not in stdout
    assert (
        f"{mlflow_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        "?workflowType=machine_learning" in stdout
    )
    assert f"{mlflow_server}/#/models/browser-cartpole/versions/1?workflowType=machine_learning" in stdout


def test_prefect_flow_run_page_shows_the_completed_run_its_stages_logs_and_artifacts(
    trained_through_the_stack, prefect_server, browser, screenshots
):
    *_, flow_run_id = trained_through_the_stack
    ui = prefect_server.removesuffix("/api")
    page = _open(
        browser,
        f"{ui}/runs/flow-run/{flow_run_id}",
        "Completed",
        "Ray ready",
        "trained to env step",
        "mean return",
        "promoted: first champion",
    )
    assert "Can't connect" not in page
    _click_tab(browser, "Artifacts")
    _wait_for(browser, "training-summary", "mlflow-run")
    browser.save_screenshot(str(screenshots / "prefect-artifacts.png"))
    _click_tab(browser, "Logs")  # by now the run graph (a canvas) has drawn too
    _wait_for(browser, "Ray ready", "trained to env step")
    browser.save_screenshot(str(screenshots / "prefect-flow-run.png"))

    tasks = _task_runs(prefect_server, flow_run_id)
    stages = [
        "check_storage",
        "start_tracking_run",
        "start_ray",
        "probe_env",
        "train_policy",
        "evaluate_policy",
        "register_model",
        "promote_if_better",
        "publish_summary",
        "finish_tracking_run",
    ]
    assert set(stages) <= set(tasks), sorted(tasks)
    _click_tab(browser, "Task Runs")  # the gate's tasks are this run's own (no subflow run: PrefectHQ/prefect#18680)
    _wait_for(browser, *(f"{stage}-" for stage in stages))
    browser.save_screenshot(str(screenshots / "prefect-task-runs.png"))
    _open(browser, f"{ui}/runs/task-run/{tasks['start_ray']}", "start_ray", "Completed", "Ray ready")
    browser.save_screenshot(str(screenshots / "prefect-task-run.png"))


def test_mlflow_pages_show_curves_dashboard_metrics_plots_and_the_champion(
    trained_through_the_stack, mlflow_server, browser, screenshots
):
    _, run, _ = trained_through_the_stack
    client = mlflow.MlflowClient(mlflow_server)
    version = client.get_model_version_by_alias("browser-cartpole", "champion")
    model = client.get_logged_model(version.source.removeprefix("models:/"))
    assert {"eval/mean_return", "eval/std_return"} <= {metric.key for metric in model.metrics}
    assert "None" not in run.data.params.values()

    base = f"{mlflow_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    query = "?workflowType=machine_learning"
    _open(
        browser,
        base + query,
        "perf/rollout_efficiency",
        "perf/gradient_delay_ms",
        "perf/policy_lag",
        "perf/rollout_bytes",
        "perf/cpu_percent",
        "eval/mean_return",
        "browser-cartpole",
        "opentinker train flow",
        "Prefect flow run",
    )
    _close_mlflow_overlays(browser)
    browser.save_screenshot(str(screenshots / "mlflow-run.png"))

    _open(browser, f"{base}/model-metrics{query}", "episodic_return_mean", "Step")
    _close_mlflow_overlays(browser)
    browser.save_screenshot(str(screenshots / "mlflow-learning-curves.png"))
    from selenium.webdriver.common.keys import Keys

    # Charts render as they scroll into view (about six of a section's charts at first): filter instead of scrolling,
    # one narrow filter per dashboard metric, so the check does not depend on how many perf/ metrics a run has.
    search = browser.find_element("css selector", "input[placeholder='Search metric charts']")
    for term, charts in (
        ("perf/gradient_delay", ["perf/gradient_delay_ms"]),
        ("perf/policy_lag", ["perf/policy_lag"]),
        ("perf/cpu_percent", ["perf/cpu_percent"]),
        ("perf/rollout", ["perf/rollout_efficiency", "perf/rollout_bytes"]),
    ):
        search.send_keys(Keys.CONTROL, "a")  # React's input ignores WebElement.clear(): select and overwrite
        search.send_keys(term)
        _wait_for(browser, *charts, "Step")
    browser.save_screenshot(str(screenshots / "mlflow-dashboard-metrics.png"))

    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    # chart titles drop the section's "system/" prefix; the legend shows it only once a chart has several points
    _open(browser, f"{base}/system-metrics{query}", "System metrics", "cpu_utilization_percentage")
    _close_mlflow_overlays(browser)
    browser.save_screenshot(str(screenshots / "mlflow-system-metrics.png"))
    browser.find_element("css selector", "input[placeholder='Search metric charts']").send_keys("memory")
    _wait_for(browser, "system_memory_usage_megabytes")

    _open(
        browser,
        f"{base}/artifacts/plots/learning_curve.png{query}",
        "learning_curve.png",
        "perf_metrics.png",
        "evaluation_returns.png",
    )
    _wait_for_image(browser)
    _close_mlflow_overlays(browser)
    browser.save_screenshot(str(screenshots / "mlflow-artifacts.png"))
    shown = browser.find_element("css selector", "img[src^='blob:']").get_attribute("src")
    browser.find_element("xpath", "//*[normalize-space()='evaluation_returns.png']").click()
    _wait_for(browser, "plots/evaluation_returns.png")
    _wait_for_image(browser, other_than=shown)
    browser.save_screenshot(str(screenshots / "mlflow-evaluation.png"))

    _open(browser, f"{mlflow_server}/#/models{query}", "browser-cartpole", "champion")
    _close_mlflow_overlays(browser)
    browser.find_element("xpath", "//button[normalize-space()='+1']").click()  # the other alias of the version
    _wait_for(browser, "champion", "candidate")
    browser.save_screenshot(str(screenshots / "mlflow-registered-models.png"))

    _open(
        browser,
        f"{mlflow_server}/#/models/browser-cartpole/versions/{version.version}{query}",
        "champion",
        "candidate",
        "Release gate: promoted: first champion",
    )
    _close_mlflow_overlays(browser)
    browser.save_screenshot(str(screenshots / "mlflow-model-version.png"))


def test_prefect_shows_a_server_job_in_its_tenants_work_queue(job_server, browser, screenshots):
    """A job submitted to `opentinker server up` is a flow run in its tenant's work queue, whose concurrency limit is
    the tenant's running-jobs quota."""
    server = job_server
    key = server.make_key("dashboards")
    spec = {"env_id": "CartPole-v1", "steps": 2048, "num_envs": 4, "eval_episodes": 2, "champion_threshold": 0.0}
    job = httpx.post(f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": spec}, timeout=120).json()
    wait_for_job(server, key, job["id"], lambda s: s["state"] == "SUCCEEDED")
    page = _open(
        browser,
        f"{server.prefect_url}/work-pools/work-pool/opentinker-jobs/queue/tenant-dashboards",
        "tenant-dashboards",
        "Jobs of tenant dashboards",
        "Flow Run Concurrency",
    )
    assert "Can't connect" not in page
    browser.find_element("xpath", "//li[contains(@class, 'p-tab') and normalize-space()='Runs']").click()
    _wait_for(browser, job["id"], "tenant:dashboards", "Completed")
    browser.save_screenshot(str(screenshots / "prefect-tenant-queue.png"))
