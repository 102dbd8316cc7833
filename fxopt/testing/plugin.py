"""The fxopt pytest plugin, registered through the ``pytest11`` entry point.

Fixtures:

* ``fx_case`` — parametrized over the model zoo (:mod:`fxopt.testing.zoo`) times each
  case's dtypes; a test receives a :class:`~fxopt.testing.zoo.CaseInstance` (``.gm``,
  ``.inputs``, ``.rtol``, ``.atol``, ``.tags``). Test ids read ``<case>-<dtype>``, so
  ``-k "attention and float16"`` works.
* ``check_pass`` — :func:`fxopt.testing.check_pass` bound to the test's name and to
  ``--fxopt-artifacts=DIR``: on failure, ``DIR/<test>/`` receives a runnable repro of the
  minimized graph, the graph itself, the diff and the error.

Markers choose the cases a test runs on::

    @pytest.mark.fxopt_tags("conv", "bn")          # cases with any of these tags
    @pytest.mark.fxopt_exclude_tags("large")       # ...but none of these
    @pytest.mark.fxopt_dtypes("float32", "bfloat16")
    @pytest.mark.fxopt_cases("attention", "mlp")   # by name
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

_MARKERS = {
    "fxopt_tags": "fxopt_tags(*tags): run fx_case only on zoo cases having any of these tags",
    "fxopt_exclude_tags": "fxopt_exclude_tags(*tags): skip zoo cases having any of these tags",
    "fxopt_dtypes": "fxopt_dtypes(*dtypes): run fx_case only in these dtypes ('float16', ...)",
    "fxopt_cases": "fxopt_cases(*names): run fx_case only on these zoo cases",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fxopt")
    group.addoption("--fxopt-artifacts", metavar="DIR", default=None,
                    help="on a failed check_pass, write a runnable repro, the minimized graph "
                         "and the diff under DIR/<test name>/")


def pytest_configure(config: pytest.Config) -> None:
    for line in _MARKERS.values():
        config.addinivalue_line("markers", line)


def _marker_args(metafunc: pytest.Metafunc, name: str) -> list[str]:
    return [arg for mark in metafunc.definition.iter_markers(name) for arg in mark.args]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fx_case" not in metafunc.fixturenames:
        return
    import torch

    from fxopt.testing import zoo

    dtypes = _marker_args(metafunc, "fxopt_dtypes")
    wanted = {getattr(torch, d) if isinstance(d, str) else d for d in dtypes}
    cases = zoo.select(_marker_args(metafunc, "fxopt_tags"), _marker_args(metafunc, "fxopt_exclude_tags"),
                       _marker_args(metafunc, "fxopt_cases"))
    params = [(case, dtype) for case in cases for dtype in case.dtypes if not wanted or dtype in wanted]
    ids = [f"{case.name}-{str(dtype).removeprefix('torch.')}" for case, dtype in params]
    metafunc.parametrize("fx_case", params, ids=ids, indirect=True)


@pytest.fixture
def fx_case(request: pytest.FixtureRequest) -> Any:
    """A zoo case built in one dtype (see the module docstring for selecting cases)."""
    case, dtype = request.param
    return case.instantiate(dtype)


@pytest.fixture
def check_pass(request: pytest.FixtureRequest) -> Any:
    """``check_pass(passes, model_or_fx_case, inputs=None, *, rtol=None, atol=None)``:
    run the passes, assert equivalence, return the optimized graph; artifacts on failure
    go to ``--fxopt-artifacts``."""
    from fxopt.testing.check import check_pass as check

    return functools.partial(check, artifacts=request.config.getoption("--fxopt-artifacts"),
                             name=request.node.name)
