"""The hand-off to ``torch.compile``: what fxopt does between Dynamo and Inductor.

A graph's way through, and the file for each step:

1. Dynamo captures a graph and calls the ``fxopt`` backend (``backend.py``) with it.
   :func:`compile` is ``torch.compile`` with that backend; ``options.py`` checks its
   options before anything compiles and turns them into Inductor config patches.
2. The backend works on a copy. On inference graphs the weights become constants
   (``freezing.py``); the user's torch-level passes run, then the layout passes and, where
   sizes are symbolic, the deferred attention choice (``attention.py``). A failing pass
   sends the graph to plain Inductor.
3. Inductor compiles the result. ATen-level pipelines run inside it as cache-safe custom
   passes (``inductor_pass.py``). What Inductor cannot fuse itself is ``torch.ops.fxopt.*``
   (``fused_ops.py``), the linear + GELU GEMM among them (``gemm_gelu.py``).
4. Back to Dynamo goes a callable: inference graphs replayed as CUDA graphs
   (``replay.py``), training steps through Inductor's CUDA-graph trees with plain-call
   semantics (``training.py``), frozen weights watched for writes (``freezing.py``).

Beside the path: ``guards.py``, the dtype checks a pass such as ``inplace`` puts in a graph
it specialized (Dynamo drops them at trace time); ``seeding.py``, torch's generator seeded
for a verifying run, only for graphs that draw random numbers (both are used outside the
compile path too: they import nothing of it); ``profile.py``, a model compiled here and
handed to :mod:`fxopt.profiling`, which sits below and never imports the backend.

Importing this package loads nothing heavy; :func:`compile` loads the backend (Inductor,
seconds) on its first call. Once ``fxopt`` is imported, ``fxopt.compile`` is that function,
not this package: import the modules with ``from fxopt.compile import backend`` or
``from fxopt.compile.backend import ...``, not ``import fxopt.compile.backend as ...``.
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

    ``options`` takes the other backend options (see :class:`~fxopt.compile.options.BackendOptions`);
    ``torch_compile_kwargs`` go to ``torch.compile`` (``dynamic``, ``fullgraph``, ``mode``).
    Options are validated here, so mistakes raise at once rather than at the first call.
    """
    from fxopt.compile.backend import fxopt_backend  # Inductor: seconds
    from fxopt.compile.options import BACKEND, BackendOptions

    opts = dict(options or {})
    if passes is not None:
        if "passes" in opts:
            raise PassOptionError(BACKEND, "passes", "given both as an argument and in options")
        opts["passes"] = passes
    mode = torch_compile_kwargs.pop("mode", None)
    if mode is not None and "mode" in opts:  # the argument would win at run time, unchecked here
        raise PassOptionError(BACKEND, "mode", "given both as an argument and in options")
    BackendOptions.parse(opts, mode)
    if mode is not None:
        opts["mode"] = mode
    return torch.compile(model, backend=fxopt_backend, options=opts, **torch_compile_kwargs)
