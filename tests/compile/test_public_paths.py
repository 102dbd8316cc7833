"""The compile path moved into the package fxopt.compile; what users imported from the old
places still imports from there, as the very same objects."""

import importlib
import importlib.metadata
import inspect
import pkgutil
import sys

import pytest

import fxopt

#: the package, which the attribute ``fxopt.compile`` (the function) hides
PACKAGE = sys.modules["fxopt.compile"]


def test_fxopt_compile_stays_the_function_after_every_module_of_its_package_is_imported():
    for module in pkgutil.iter_modules(PACKAGE.__path__):
        importlib.import_module(f"fxopt.compile.{module.name}")
    assert inspect.isfunction(fxopt.compile)
    assert fxopt.compile is PACKAGE.compile
    assert list(inspect.signature(fxopt.compile).parameters)[:3] == ["model", "passes", "options"]
    from fxopt import compile

    assert compile is fxopt.compile


@pytest.mark.parametrize(("old", "names", "new"), [
    ("fxopt.backend", ["fxopt_backend", "CompiledGraph", "is_training"], "fxopt.compile.backend"),
    ("fxopt.backend", ["BackendOptions", "INDUCTOR_HOOKS"], "fxopt.compile.options"),
    ("fxopt.backend", ["InductorPass"], "fxopt.compile.inductor_pass"),
    ("fxopt.backend", ["compile"], "fxopt.compile"),
    ("fxopt", ["compile"], "fxopt.compile"),
    ("fxopt", ["profile_compiled"], "fxopt.compile.profile"),
    ("fxopt.profiling", ["profile_compiled"], "fxopt.compile.profile"),
])
def test_old_import_paths_give_the_same_objects(old, names, new):
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), f"{old}.{name}"
    assert set(names) <= set(old_module.__all__)


@pytest.mark.parametrize("name", ["fused_ops", "gemm_gelu", "guards"])
def test_old_module_names_are_the_moved_modules_themselves(name):
    old = importlib.import_module(f"fxopt.{name}")
    assert old is importlib.import_module(f"fxopt.compile.{name}")
    assert getattr(fxopt, name) is old


def test_the_dynamo_entry_point_names_the_backend_in_its_new_home():
    try:
        points = importlib.metadata.distribution("fxopt").entry_points
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source tree, not installed
        pytest.skip("fxopt is not installed")
    (point,) = [p for p in points if p.group == "torch_dynamo_backends" and p.name == "fxopt"]
    from fxopt.compile.backend import fxopt_backend

    assert point.value == "fxopt.compile.backend:fxopt_backend"
    assert point.load() is fxopt_backend
