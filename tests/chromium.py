"""The one way the browser tests start a browser: Debian's chromium (``apt-get install -y chromium``)
through Playwright, headless, with nothing in it reaching out on its own. A test that needs it is
skipped, saying why, when chromium or Playwright is missing."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
MISSING = "Debian's chromium is not installed (apt-get install -y chromium)"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    # a download (Save PNG / SVG) would otherwise wait seconds on a check that cannot reach out
    "--safebrowsing-disable-download-protection",
]


def chromium_path() -> str | None:
    """Debian's chromium, or one on PATH; None without one."""
    return CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")


def playwright_or_skip(*, module: bool = False) -> Any:
    """Playwright's sync API; the test (or with ``module``, the whole module) skipped without it or
    without chromium."""
    if chromium_path() is None:
        pytest.skip(MISSING, allow_module_level=module)
    return pytest.importorskip("playwright.sync_api")


@contextmanager
def chromium() -> Iterator[Any]:
    """A started chromium (Playwright's ``Browser``), closed after."""
    sync_api = playwright_or_skip()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=ARGS)
        try:
            yield browser
        finally:
            browser.close()
