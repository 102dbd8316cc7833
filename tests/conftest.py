"""Suite-wide settings: the CI profile skips `slow` tests unless FXOPT_PROFILE=long."""

import os

import pytest

LONG_PROFILE = os.environ.get("FXOPT_PROFILE") == "long"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG_PROFILE:
        return
    skip = pytest.mark.skip(reason="slow: run with FXOPT_PROFILE=long")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
