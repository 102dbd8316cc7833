"""The hand-off to ``torch.compile``: what fxopt does between Dynamo and Inductor.

A graph's way through, and the file for each step:

1. Dynamo captures a graph and calls the ``fxopt`` backend (``backend.py``) with it;
   :func:`compile` is ``torch.compile`` with that backend and validated options.
2. On inference graphs the weights become constants (freezing, in ``backend.py``); the
   user's torch-level passes run, then the layout passes and, for symbolic sizes, the
   deferred attention choice (``attention.py``). Failures fall back to plain Inductor.
3. Inductor compiles the result; ATen-level pipelines run inside it as cache-safe custom
   passes (``backend.py``). The ops Inductor cannot fuse itself are ``torch.ops.fxopt.*``
   (``fused_ops.py``), the linear + GELU GEMM among them (``gemm_gelu.py``).
4. Back to Dynamo goes a callable: inference graphs replayed as CUDA graphs
   (``replay.py``), training steps through Inductor's CUDA-graph trees with plain-call
   semantics (``training.py``).

Beside the path: ``guards.py`` holds the run-time input checks passes insert, and
``seeding.py`` the seeded random state that lets a check compare random ops.

Importing this package loads nothing heavy: the backend imports Inductor (seconds), so
:func:`compile` loads it on its first call. ``fxopt.compile`` is this function once
``fxopt`` is imported: import the package's modules with ``from fxopt.compile import ...``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from fxopt.errors import PassOptionError

if TYPE_CHECKING:
    from fxopt.pipeline import PassLike

__all__ = ["compile"]


def compile(model: Callable, passes: PassLike | Iterable[PassLike] | None = None, *,
            options: Mapping[str, Any] | None = None, **torch_compile_kwargs: Any) -> Callable:
    """``torch.compile(model, backend="fxopt")`` with ``passes`` as the torch-level pipeline.

    ``options`` takes the other backend options (see :class:`~fxopt.compile.backend.BackendOptions`);
    ``torch_compile_kwargs`` go to ``torch.compile`` (``dynamic``, ``fullgraph``, ``mode``).
    Options are validated here, so mistakes raise at once rather than at the first call.
    """
    from fxopt.compile.backend import _BACKEND, BackendOptions, fxopt_backend  # Inductor: seconds

    opts = dict(options or {})
    if passes is not None:
        if "passes" in opts:
            raise PassOptionError(_BACKEND, "passes", "given both as an argument and in options")
        opts["passes"] = passes
    mode = torch_compile_kwargs.pop("mode", None)
    BackendOptions.parse(opts, mode)
    if mode is not None:
        opts["mode"] = mode
    return torch.compile(model, backend=fxopt_backend, options=opts, **torch_compile_kwargs)
