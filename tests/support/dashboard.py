"""Driving the dashboard from Debian's chromium through Playwright (no browser download).

Shared by tests/system/test_dashboard.py and bench/dashboard.py, so it needs no pytest:

- `launch`: headless chromium from `/usr/bin/chromium` (or `$COORDINATOR_CHROMIUM`);
- `Watched`: a page whose every request must stay on loopback and whose console
  must stay free of errors and uncaught exceptions; `problems()` lists what went
  wrong, `assert_clean()` fails with all of it; `answers` keeps each response's
  status and content type (the page's modules must come as JavaScript); `sign_in`
  opens the link that `coordinator serve` prints (the token in its fragment);
- `HISTORY`: an init script that records every value the page ever showed in the
  cells and attributes a test follows (a MutationObserver: it sees each DOM
  change as it happens, so no intermediate state is missed between two looks).
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, Request, Response

CHROMIUM = Path(os.environ.get("COORDINATOR_CHROMIUM", "/usr/bin/chromium"))
VIEWPORT = {"width": 1400, "height": 1000}
PHASES = ["starting", "leader_election", "ip_exchange", "connect", "training", "cleaner", "done"]
# Chromium logs every non-2xx fetch as a console error with this text (its network log).
NETWORK_ERROR = re.compile(r"^Failed to load resource: the server responded with a status of (\d+)")


def launch(playwright: Playwright) -> Browser:
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)


def on_loopback(url: str) -> bool:
    """Whether a request for `url` stays on this machine (or never leaves the page)."""
    parts = urlsplit(url)
    if parts.scheme in ("data", "blob", "about"):
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Watched:
    """A page, and what it did that a test must see: requests, console errors, exceptions."""

    page: Page
    requests: list[str] = field(default_factory=list)
    off_loopback: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    answers: dict[str, tuple[int, str]] = field(default_factory=dict)  # url -> status, type
    # (status, url path) of non-2xx answers the test provoked on purpose (a 422, say):
    # Chromium logs those as console errors although the page handled them.
    expected: set[tuple[int, str]] = field(default_factory=set)
    checked: bool = False  # assert_clean was called
    failed: bool = False  # ...and found problems

    def __post_init__(self) -> None:
        self.page.on("request", self._on_request)
        self.page.on("response", self._on_response)
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda error: self.page_errors.append(str(error)))

    def _on_request(self, request: Request) -> None:
        self.requests.append(f"{request.method} {request.url}")
        if not on_loopback(request.url):
            self.off_loopback.append(f"{request.method} {request.url}")

    def _on_response(self, response: Response) -> None:
        self.answers[response.url] = (response.status, response.headers.get("content-type", ""))

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type != "error":
            return
        where = message.location.get("url", "") if message.location else ""
        network = NETWORK_ERROR.match(message.text)
        if network and (int(network.group(1)), urlsplit(where).path) in self.expected:
            return
        self.console_errors.append(f"{message.text} ({where})" if where else message.text)

    def expect_status(self, status: int, path: str) -> None:
        """Answers `status` from `path` are the test's doing: not console errors."""
        self.expected.add((status, path))

    def problems(self) -> list[str]:
        return (
            [f"request off loopback: {r}" for r in self.off_loopback]
            + [f"console error: {e}" for e in self.console_errors]
            + [f"uncaught exception: {e}" for e in self.page_errors]
        )

    def assert_clean(self) -> None:
        self.checked = True
        problems = self.problems()
        self.failed = bool(problems)
        assert not problems, "the page misbehaved:\n" + "\n".join(problems)

    # -- conveniences -------------------------------------------------------------

    def sign_in(self, link: str, fragment: str = "#/") -> None:
        """Open `link` (the one `coordinator serve` prints: its token in the fragment, which
        the page keeps for the tab), wait until the page knows its role, go to `fragment`."""
        self.page.goto(link)
        self.page.wait_for_selector("body:not([data-role='none'])", state="attached")
        self.route(fragment)

    def route(self, fragment: str) -> None:
        """Go to `#/...` within the page: a hash change, never a reload."""
        self.page.evaluate("(hash) => { window.location.hash = hash; }", fragment)

    def mark(self) -> None:
        """Leave a mark in the page's window: `marked()` is false once it reloads."""
        self.page.evaluate("() => { window.__testMark = 'not reloaded'; }")

    def marked(self) -> bool:
        return bool(self.page.evaluate("() => window.__testMark === 'not reloaded'"))

    def history(self) -> dict[str, Any]:
        return dict(self.page.evaluate("() => window.__history"))


# Records, in order and without repeats, every value the page showed: each member row's
# phase, the job state, the curve's and the clocks chart's data-points. Installed with
# `context.add_init_script` before the page loads.
HISTORY = """
(() => {
  const history = { phases: {}, state: [], curve: [], clocks: [] };
  window.__history = history;
  const note = (list, value) => {
    if (value !== null && value !== undefined && list[list.length - 1] !== value) list.push(value);
  };
  const points = (selector) => {
    const svg = document.querySelector(selector);
    return svg && svg.hasAttribute('data-points') ? Number(svg.getAttribute('data-points')) : null;
  };
  const look = () => {
    for (const row of document.querySelectorAll('table#members tr[data-index]')) {
      const cell = row.querySelector('td.phase');
      if (!cell) continue;
      const list = (history.phases[row.dataset.index] ||= []);
      note(list, cell.textContent.trim());
    }
    const state = document.querySelector('#job-state');
    if (state) note(history.state, state.textContent.trim());
    note(history.curve, points('svg#chart-curve'));
    note(history.clocks, points('svg#chart-clocks'));
  };
  new MutationObserver(look).observe(document, {
    subtree: true, childList: true, characterData: true, attributes: true,
  });
})();
"""
