"""The fxopt pytest plugin, registered through the ``pytest11`` entry point."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fxopt_case(tags): an fxopt model-zoo case")
