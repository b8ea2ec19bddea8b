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
    """`claw dashboard` on a loopback port, reading `lake` (`secrets`: the secrets.toml of its
    OpenID Connect login, written before `start()`; its redirect_uri needs `url`)."""

    def __init__(self, lake: Path, log_path: Path, secrets: Path | None = None, **env: str) -> None:
        env = {"CLAW_LAKE_URI": str(lake), "CLAW_GATEWAY_URL": "http://127.0.0.1:9", **env}
        args = ("--lake", str(lake), "--host", "127.0.0.1")
        super().__init__(
            "dashboard",
            log_path,
            health="/_stcore/health",
            args=args if secrets is None else (*args, "--secrets", str(secrets)),
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
    """A headless Chromium tab on one dashboard; `received` keeps every websocket message the
    server sent it (what reached the browser, charts' and tables' data included)."""

    def __init__(self, page, base_url: str) -> None:
        self.page, self.base_url = page, base_url
        self.received: list[bytes] = []
        page.on("websocket", lambda socket: socket.on("framereceived", self._keep))

    def _keep(self, payload: bytes | str) -> None:
        self.received.append(payload.encode() if isinstance(payload, str) else payload)

    def was_sent(self, text: str | bytes) -> bool:
        """Whether any message the server sent this tab holds `text` (UTF-8), or those bytes
        (e.g. a float64 as Arrow holds it in a table's or a chart's data)."""
        needle = text.encode() if isinstance(text, str) else text
        return any(needle in message for message in self.received)

    def text(self) -> str:
        """What the page shows as text, and its HTML (attributes included)."""
        return self.page.inner_text("body") + "\n" + self.page.content()

    def open(self, name: str, timeout_s: float = 60.0) -> Visit:
        """Go to page `name` by its link in the sidebar (the same session: a login holds)."""
        started = time.perf_counter()
        nav = self.page.locator('[data-testid="stSidebarNav"]')
        nav.get_by_role("link", name=name, exact=True).click()
        return self.wait(name, started, timeout_s)

    def log_in_with_key(self, key: str) -> None:
        """Type `key` into the login page and submit it."""
        self.page.get_by_label("API key", exact=True).fill(key)
        self.page.get_by_role("button", name="Log in with key").click()
        self.settle()

    def visit(self, name: str, timeout_s: float = 60.0) -> Visit:
        """Load page `name` fresh and wait until its script has run to the end."""
        started = time.perf_counter()
        self.page.goto(f"{self.base_url}/{PAGES[name]}")
        return self.wait(name, started, timeout_s)

    def wait(self, name: str, started: float | None = None, timeout_s: float = 60.0) -> Visit:
        """Wait for `name`'s title, then for the run to finish (main content drawn); times
        count from `started` (default: now)."""
        started = time.perf_counter() if started is None else started
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


class Chromium:
    """One headless Chromium; each tab of it a context of its own (its own cookies)."""

    def __init__(self, chromium) -> None:
        self.chromium = chromium

    @contextmanager
    def tab(self, base_url: str, width: int = 1400, height: int = 1000) -> Iterator[Browser]:
        """A fresh tab pointed at `base_url` (no cookie of another tab)."""
        context = self.chromium.new_context(viewport={"width": width, "height": height})
        try:
            yield Browser(context.new_page(), base_url)
        finally:
            context.close()


@contextmanager
def chromium() -> Iterator[Chromium]:
    """Headless Chromium (Debian's), until the block ends; Playwright's sync API allows one
    at a time in a thread, so tests that need several tabs share this."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        try:
            yield Chromium(launched)
        finally:
            launched.close()


@contextmanager
def browser(base_url: str, width: int = 1400, height: int = 1000) -> Iterator[Browser]:
    """A headless Chromium tab pointed at `base_url`."""
    with chromium() as launched, launched.tab(base_url, width, height) as tab:
        yield tab
