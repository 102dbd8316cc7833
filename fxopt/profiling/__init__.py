"""Profile-guided optimization: where a graph spends its time and memory, node by node.

- :func:`profile` measures every node of a GraphModule under ``torch.profiler``
  (time, live memory, FLOPs) and returns a :class:`Profile` with hotspot tables;
- :meth:`Profile.diff` / ``fxopt.optimize(..., profile=fxopt.profile)`` attribute the change a
  pipeline made to the passes and the nodes they rewrote (:class:`ProfileDiff`);
- :func:`profile_compiled` maps the kernels Inductor generated for a ``torch.compile``-d
  model back to the FX nodes they compute.
"""

from fxopt.profiling.diff import PassChange, ProfileDiff
from fxopt.profiling.inductor import CompiledProfile, KernelProfile, profile_compiled
from fxopt.profiling.kinds import KINDS, op_kind
from fxopt.profiling.result import NodeProfile, Profile
from fxopt.profiling.run import profile

__all__ = ["KINDS", "CompiledProfile", "KernelProfile", "NodeProfile", "PassChange", "Profile",
           "ProfileDiff", "op_kind", "profile", "profile_compiled"]
