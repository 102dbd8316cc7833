"""A model compiled with the ``fxopt`` backend, its kernels profiled: the compile path's half
of kernel profiling. Profiling measures a compiled callable
(:func:`fxopt.profiling.profile_kernels`) and never imports the backend; this module compiles
the model for it, with the Inductor options that make kernels traceable to FX nodes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fxopt.compile import compile
from fxopt.profiling.inductor import CompiledProfile, kernel_profile_options, profile_kernels

__all__ = ["profile_compiled"]


def profile_compiled(model: torch.nn.Module, example_inputs: Sequence[Any], *, passes: Any = None,
                     options: Mapping[str, Any] | None = None, warmup: int = 2,
                     repeat: int = 5) -> CompiledProfile:
    """Compile ``model`` with the ``fxopt`` backend, run it, and attribute each kernel's time
    to the FX nodes it computes. ``passes``/``options`` are :func:`fxopt.compile`'s; the
    result's ``graphs`` are the backend's records of the graphs it compiled."""
    opts = dict(options or {})
    graphs: list[Any] = opts.setdefault("reports", [])
    opts["inductor"] = {**opts.get("inductor", {}), **kernel_profile_options()}
    return profile_kernels(compile(model, passes, options=opts), example_inputs, graphs=graphs,
                           warmup=warmup, repeat=repeat)
