"""Fixtures for the visualize tests: the Graphviz renderer and a headless Chromium.

Chromium is found, or installed with apt-get on CI. The interactive report tests drive
it through playwright (the [test] extra): they use playwright's own browser (``playwright
install chromium``, never run for you) or else a system Chromium, found or installed as
below, and skip, saying so, when there is neither.

CI runs as root on a fresh Debian machine, so the set-up installs Debian's ``chromium``
package once (under a file lock: two xdist workers may ask at the same time). Elsewhere
a missing browser skips the tests that need it, saying how to get one.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
)


def _which() -> str | None:
    return next(filter(None, map(shutil.which, CANDIDATES)), None)


def find_or_install_chromium(why: str = "headless Chromium is not installed") -> str:
    """The path of a chromium binary; installs Debian's package when root and missing,
    else skips the test, giving ``why`` and how to install one."""
    found = _which()
    if found:
        return found
    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{why} (Debian: apt-get install chromium)")
    with open(os.path.join(tempfile.gettempdir(), "fxopt-chromium-install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _which()  # another worker may have installed it while we waited
        if found:
            return found
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium",
                     "fonts-liberation"]):
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=900)
    found = _which()
    if not found:
        raise RuntimeError("apt-get installed chromium but no chromium binary is on PATH")
    return found


@dataclass
class PageLoad:
    """What Chromium saw when it loaded a page: the DOM after scripts ran, and every
    console message (Chromium logs them all at INFO level, errors and uncaught
    exceptions included, so the level cannot tell them apart: callers that expect a
    silent page assert that there are none)."""

    dom: str
    console: list[str]


_CONSOLE = re.compile(r':CONSOLE[:(]?\d*\)?\] "(.*)", source: ')


def _run(binary: str, page: Path, extra: list[str], profile: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [binary, *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def load(binary: str, page: Path, screenshot: Path | None = None,
         window: str = "1400,2400", timeout: float = 90) -> PageLoad:
    """Open ``page`` in headless Chromium (a fresh profile); its DOM and console messages."""
    with tempfile.TemporaryDirectory(prefix="fxopt-chromium-") as profile:
        done = _run(binary, page, ["--dump-dom", "--virtual-time-budget=2000"], profile, timeout)
        if screenshot is not None:
            shot = _run(binary, page, [f"--screenshot={screenshot}", f"--window-size={window}",
                                       "--hide-scrollbars"], profile, timeout)
            if not screenshot.exists():
                raise RuntimeError(f"chromium wrote no screenshot: {shot.stderr[-2000:]}")
    if not done.stdout:
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    console = [m.group(1) for m in map(_CONSOLE.search, done.stderr.splitlines()) if m]
    return PageLoad(done.stdout, console)


@pytest.fixture(scope="session")
def chromium() -> str:
    return find_or_install_chromium()


@pytest.fixture(scope="session")
def browser(chromium: str):
    """``browser(page, screenshot=None) -> PageLoad``: open a page in headless Chromium."""
    return lambda page, screenshot=None: load(chromium, page, screenshot)


@pytest.fixture(scope="session")
def renderer() -> str:
    """graphviz-pure comes with the [test] extra: its absence is a broken set-up, not a skip."""
    from fxopt.visualize import find_renderer

    return find_renderer()


@pytest.fixture(scope="session")
def playwright_browser():
    """A headless Chromium driven by playwright: its own build, else a system Chromium
    (installed with apt-get when root, as on CI, like the ``chromium`` fixture's)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                                   "(it comes with the [test] extra)")
    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch()
        except sync_api.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            system = find_or_install_chromium(f"no browser for playwright ({first}): run "
                                              "`.venv/bin/playwright install chromium`, or install Chromium")
            browser = p.chromium.launch(executable_path=system)
        yield browser
        browser.close()
