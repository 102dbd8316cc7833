"""The ``fxopt`` backend's old home, kept for code that imports it (and for the entry point
of installs made before it moved): the backend is the package :mod:`fxopt.compile` now."""

from fxopt.compile import compile
from fxopt.compile.backend import CompiledGraph, fxopt_backend, is_training
from fxopt.compile.inductor_pass import InductorPass
from fxopt.compile.options import INDUCTOR_HOOKS, BackendOptions

__all__ = ["INDUCTOR_HOOKS", "BackendOptions", "CompiledGraph", "InductorPass", "compile", "fxopt_backend",
           "is_training"]
