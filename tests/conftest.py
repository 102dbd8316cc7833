"""Suite-wide settings: the CI profile skips `slow` tests unless FXOPT_PROFILE=long, and
under CI hypothesis runs derandomized, so a green or red CI never depends on one run's luck
(local and long-profile runs keep exploring new examples)."""

import os

import pytest
from hypothesis import settings

LONG_PROFILE = os.environ.get("FXOPT_PROFILE") == "long"

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI") and not LONG_PROFILE:
    settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG_PROFILE:
        return
    skip = pytest.mark.skip(reason="slow: run with FXOPT_PROFILE=long")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
