"""A real browser for the console's tests: Debian's ``chromium`` driven by Playwright.

Playwright's own browser download cannot work where only package registries are reachable, so
the browser is the system's (``scripts/bootstrap.sh`` installs it with apt) and Playwright is
only the driver (its wheel carries it). One browser per test module (Playwright's sync API keeps
an event loop running in the thread that started it, which would break every later test that
runs one of its own: closing the browser at the end of the module ends it); a fresh context
(cookies, storage) per test.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SCREENSHOTS = Path(__file__).resolve().parents[3] / "docs" / "console"


def chromium_path() -> str:
    """The system's Chromium; a clear failure when it is missing."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: scripts/bootstrap.sh installs Debian's chromium")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=chromium_path(), args=ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a fresh context; the test fails when the page's script threw or the browser
    reported an error (a script or style refused by the content security policy, say). A
    refused request is not one: tests make them on purpose."""
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    errors: list[str] = []
    opened = context.new_page()
    opened.on("pageerror", lambda e: errors.append(f"script error: {e}"))
    opened.on(
        "console",
        lambda m: (
            errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    try:
        yield opened
    finally:
        context.close()
    assert not errors, errors


SCREENSHOT_TRIES = 3


def screenshot(page: Page, name: str) -> Path:
    """Save the page as ``docs/console/<name>.png`` (the README links them). Headless Chromium
    on a loaded machine sometimes answers a capture with "Unable to capture screenshot" (seen
    once in CI, 2026-11-29): that is tried again, up to ``SCREENSHOT_TRIES`` times."""
    from playwright.sync_api import Error

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    for tries_left in range(SCREENSHOT_TRIES - 1, -1, -1):
        try:
            page.screenshot(path=str(path), full_page=False)
            return path
        except Error as e:
            if "Unable to capture screenshot" not in str(e) or not tries_left:
                raise
    return path
