"""The bench scripts import their harness as ``harness`` (``python bench/x.py`` puts bench/ on
the path); the tests load them the same way."""

import importlib.util
import pathlib
import sys
from collections.abc import Callable
from types import ModuleType

import pytest

from ..visualize.conftest import find_or_install_chromium

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module of its own (``bench_<name>``), as a script would run it."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def bench_script() -> Callable[[str], ModuleType]:
    return load_bench


def pytest_runtest_setup(item: pytest.Item) -> None:
    """bench/report.py's smoke drives a headless Chromium: found, or installed on CI as the
    visualize tests install theirs (whichever test asks first), else the test skips saying how."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("name") == "report":
        find_or_install_chromium("bench/report.py's smoke needs a headless Chromium")
