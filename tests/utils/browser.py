"""Debian's Chromium for the browser tests (tests/api/test_dashboard*.py, whose ``browser``
and ``page`` fixtures are in tests/api/conftest.py; the serving e2e's Try it box), driven
through playwright."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def use_key(page: Any, key: str) -> None:
    """Sign the dashboard in with an API key (its key form), and wait for the render that
    starts: a page opened with a key already stored (one browser profile per module) has
    rendered once before, and reading that first render while the second replaces it reads
    elements no longer on screen."""
    page.fill("#apikey", key)
    page.click("#keyform button[type=submit]")
    page.wait_for_selector("#view:not([aria-busy])", state="attached")
