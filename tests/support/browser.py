"""The dashboard in a real browser: `claw dashboard` on a loopback port, driven by Playwright
through Debian's `chromium` (no browser download)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from claw_pipelines.app.processes import ServiceProcess

# url path of each page (st.navigation names them after their files; overview is the default)
PAGES = {
    "Overview": "",
    "Collection": "collection",
    "Representation": "representation",
    "Curation": "curation",
    "Optimization": "optimization",
    "Consumption": "consumption",
}
# a closed network: without these, Chromium keeps dialling hosts it cannot reach
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
EXCEPTION = '[data-testid="stException"]'
DONE = '[data-testid="stApp"][data-test-script-state="notRunning"]'


def chromium_path() -> str | None:
    """The system Chromium (CLAW_CHROMIUM, else `chromium` on PATH), or None."""
    return os.environ.get("CLAW_CHROMIUM") or shutil.which("chromium")


class DashboardProcess(ServiceProcess):
    """`claw dashboard` on a loopback port, reading `lake`."""

    def __init__(self, lake: Path, log_path: Path, **env: str) -> None:
        env = {"CLAW_LAKE_URI": str(lake), "CLAW_GATEWAY_URL": "http://127.0.0.1:9", **env}
        super().__init__(
            "dashboard",
            log_path,
            health="/_stcore/health",
            args=("--lake", str(lake), "--host", "127.0.0.1"),
            env=env,
        )


@dataclass
class Visit:
    """One page load: seconds until the title showed and until the script finished."""

    page: str
    title_s: float
    done_s: float
    exceptions: int


class Browser:
    """A headless Chromium tab on one dashboard."""

    def __init__(self, page, base_url: str) -> None:
        self.page, self.base_url = page, base_url

    def visit(self, name: str, timeout_s: float = 60.0) -> Visit:
        """Load page `name` fresh and wait until its script has run to the end."""
        started = time.perf_counter()
        self.page.goto(f"{self.base_url}/{PAGES[name]}")
        return self.wait(name, started, timeout_s)

    def wait(self, name: str, started: float, timeout_s: float = 60.0) -> Visit:
        """Wait for `name`'s title, then for the run to finish (main content drawn)."""
        title = self.page.locator("h1", has_text=name)
        title.first.wait_for(state="visible", timeout=timeout_s * 1000)
        shown = time.perf_counter() - started
        self.settle(timeout_s)
        done = time.perf_counter() - started
        return Visit(name, shown, done, self.page.locator(EXCEPTION).count())

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until the current script run has finished."""
        time.sleep(0.05)  # let a rerun that a click triggered begin
        self.page.wait_for_selector(DONE, state="attached", timeout=timeout_s * 1000)

    def screenshot(self, path: Path) -> None:
        """A full-page PNG of what the user sees."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), full_page=True)


@contextmanager
def browser(base_url: str, width: int = 1400, height: int = 1000) -> Iterator[Browser]:
    """A headless Chromium tab pointed at `base_url`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = chromium.new_page(viewport={"width": width, "height": height})
            yield Browser(page, base_url)
        finally:
            chromium.close()
