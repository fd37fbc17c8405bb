"""The live status page at `/`, in a real headless Chromium, against a real model.

Needs Debian's chromium (scripts/test.sh installs it); the page has no external assets.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, Route, sync_playwright

from tests.factories import Running, default_config, serve

pytestmark = pytest.mark.real

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def page_server(models_dir: Path) -> Iterator[Running]:
    config = default_config(models_dir, only_models=["all-minilm-l6-v2", "minilm-rerank"])
    with serve(config) as running:
        yield running


@pytest.fixture()
def page(page_server: Running) -> Iterator[Page]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed; scripts/test.sh installs Debian's package")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            tab = browser.new_page()
            tab.goto(page_server.url + "/")
            yield tab
        finally:
            browser.close()


def wait_for_poll(page: Page) -> int:
    """Wait for the page's next refresh to finish; return the poll count."""
    before = int(page.get_attribute("[data-testid=updated]", "data-polls") or 0)
    page.wait_for_function(
        f"Number(document.querySelector('[data-testid=updated]').dataset.polls || 0) > {before}",
        timeout=15_000)
    return before + 1


def test_page_shows_what_the_api_reports_and_follows_changes(page: Page,
                                                              page_server: Running) -> None:
    with page_server.client() as c:
        assert c.post("/v1/residency/all-minilm-l6-v2/load").json()["state"] == "hot"
        assert c.post("/v1/residency/all-minilm-l6-v2/unload").json()["state"] == "cold"
        wait_for_poll(page)
        residency = c.get("/v1/residency").json()
        device = residency["devices"][0]
        # Every model with the state the API gives; the budget the API gives.
        for m in residency["models"]:
            assert page.text_content(f"[data-testid='state-{m['name']}']") == m["state"]
        assert int(page.get_attribute(f"[data-testid='budget-{device['name']}']",
                                      "data-bytes") or -1) == device["budget_bytes"]
        assert page.locator("[data-testid=budget-line]").count() == 1

        # A request loads the model and is timed: the page follows without a reload.
        for _ in range(3):
            c.post("/v1/embeddings", json={"model": "all-minilm-l6-v2",
                                           "input": "status page"}).raise_for_status()
        page.wait_for_function(
            "document.querySelector(\"[data-testid='state-all-minilm-l6-v2']\")"
            ".textContent === 'hot'", timeout=15_000)
        wait_for_poll(page)
        residency = c.get("/v1/residency").json()
        summary = c.get("/v1/metrics/summary").json()

    row = next(m for m in residency["models"] if m["name"] == "all-minilm-l6-v2")
    segment = page.locator("rect[data-model='all-minilm-l6-v2+minilm-rerank']")
    assert segment.count() == 1  # shared weights drawn once
    assert int(segment.get_attribute("data-bytes") or -1) == row["bytes_measured"]
    assert segment.get_attribute("data-tier") == "hot"
    used = page.get_attribute(f"[data-testid='used-{device['name']}']", "data-bytes")
    assert int(used or -1) == summary["devices"][0]["used_bytes"]
    embed = next(t for t in summary["latency"]["by_task"] if t["task"] == "embed")
    assert page.text_content("[data-testid=count-embed]") == str(embed["count"])
    assert float(page.get_attribute("[data-testid=p95-embed]", "data-seconds") or -1) \
        == pytest.approx(embed["p95_seconds"])
    cost = next(m for m in summary["cost"]["models"] if m["model"] == "all-minilm-l6-v2")
    assert page.text_content("[data-testid='tokens-all-minilm-l6-v2']") == str(cost["tokens"])
    kinds = page.eval_on_selector_all("[data-testid=events] li",
                                      "items => items.map(i => i.dataset.kind)")
    assert "load" in kinds and "evict" in kinds


def test_page_shows_a_download_in_flight_and_when_it_stalls(page: Page) -> None:
    """A Hub download's progress in the model's state (the page's own rendering of the
    `download` field of /v1/residency, which the browser is handed here: the Hub downloads
    themselves are tested in tests/test_hub.py)."""
    def with_download(route: Route) -> None:
        body = route.fetch().json()
        (model,) = (m for m in body["models"] if m["name"] == "all-minilm-l6-v2")
        model["download"] = {"source": "hf:org/repo", "done_bytes": 10 << 20,
                             "total_bytes": 100 << 20, "idle_s": 42.0}
        route.fulfill(json=body)

    page.route("**/v1/residency", with_download)
    wait_for_poll(page)
    wait_for_poll(page)
    text = page.inner_text("[data-testid=state-all-minilm-l6-v2]")
    assert text.endswith(", downloading hf:org/repo: 10.0 MiB of 100.0 MiB, no byte "
                                   "for 42 s"), text


def test_page_shows_engine_crashes_through_the_front(tmp_path: Path) -> None:
    """Served by the front (`packserve serve`): the worker's state and a crash appear."""
    import os
    import signal

    from tests.factories import fake_config, serve_process

    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed; scripts/test.sh installs Debian's package")
    with serve_process(fake_config(tmp_path), tmp_path) as srv, sync_playwright() as p:
        pid = srv.worker_pid()
        os.kill(pid, signal.SIGSEGV)
        srv.wait_ready(other_than_pid=pid)
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            tab = browser.new_page()
            tab.goto(srv.url + "/")
            tab.wait_for_selector("[data-testid=crashes] li[data-signal=SIGSEGV]",
                                  timeout=15_000)
            assert f"pid {srv.worker_pid()}" in (tab.text_content("#worker") or "")
        finally:
            browser.close()


def test_page_shows_a_runners_death_and_why(page: Page, page_server: Running) -> None:
    """A runner killed (what the OOM killer does): the page lists its death under the engine
    crashes, naming the models that share it, the cause and what the crash rule made of it."""
    import os
    import signal

    from tests.factories.processes import runner_of

    with page_server.client() as c:
        assert c.post("/v1/residency/all-minilm-l6-v2/load").json()["state"] == "hot"
        pid = runner_of("minilm")
        os.kill(pid, signal.SIGKILL)
        item = page.wait_for_selector("[data-testid=crashes] li[data-signal=SIGKILL]",
                                      timeout=15_000)
        assert item is not None
        text = item.text_content() or ""
        assert f"(pid {pid})" in text and "all-minilm-l6-v2" in text and "minilm-rerank" in text
        assert "loaded again by its next request" in text
        assert c.post("/v1/embeddings", json={"model": "all-minilm-l6-v2",
                                              "input": "back"}).status_code == 200
