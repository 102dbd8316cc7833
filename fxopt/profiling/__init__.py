"""Profile-guided optimization: where a graph spends its time and memory, node by node.

- :func:`profile` measures every node of a GraphModule under ``torch.profiler``
  (time, live memory, FLOPs) and returns a :class:`Profile` with hotspot tables;
- :meth:`Profile.diff` / ``fxopt.optimize(..., profile=fxopt.profile)`` attribute the change a
  pipeline made to the passes and the nodes they rewrote (:class:`ProfileDiff`);
- :func:`profile_kernels` maps the kernels Inductor generated for a ``torch.compile``-d
  callable back to the FX nodes they compute; :func:`fxopt.profile_compiled` compiles a
  model with the ``fxopt`` backend for it.

Profiling sits below the compile path: it takes compiled callables and never imports the
backend. ``fxopt.profiling.profile_compiled``, its old home, loads the compile path's on use.
"""

from fxopt.profiling.diff import PassChange, ProfileDiff
from fxopt.profiling.inductor import (
    CompiledProfile,
    KernelProfile,
    kernel_profile_options,
    profile_kernels,
)
from fxopt.profiling.kinds import KINDS, op_kind
from fxopt.profiling.result import NodeProfile, Profile
from fxopt.profiling.run import profile


def __getattr__(name: str):
    if name == "profile_compiled":
        from fxopt.compile.profile import profile_compiled

        return profile_compiled
    raise AttributeError(f"module 'fxopt.profiling' has no attribute {name!r}")


__all__ = ["KINDS", "CompiledProfile", "KernelProfile", "NodeProfile", "PassChange", "Profile",
           "ProfileDiff", "kernel_profile_options", "op_kind", "profile", "profile_compiled", "profile_kernels"]
