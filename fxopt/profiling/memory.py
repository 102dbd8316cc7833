"""The predicted side of the live-memory curve: what the liveness analysis expects.

The measured curve (allocator events) is put next to the prediction fxopt's own analyses
make from shapes alone: the bytes of every storage the graph creates (inputs, parameters
and constants excluded, as in the measurement), summed over the node interval where the
``liveness`` analysis says it is live. A gap between the two points at allocations the
analysis cannot see (workspaces, temporaries inside a module call) or at a value freed
later than necessary. ``plan_memory``'s arena, when the graph carries a plan, is the third
line of the plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from fxopt.context import PassContext
from fxopt.errors import FxoptError
from fxopt.snapshot import GraphSnapshot


def predicted_live_bytes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[int] | None:
    """Bytes live while each node runs (graph order: its inputs still needed and its
    output), by the liveness analysis; comparable to ``NodeProfile.peak_bytes``. None when
    shapes cannot be propagated (data-dependent or symbolic sizes)."""
    from fxopt.memory.plan import _storage_nbytes

    snapshot = GraphSnapshot.take(gm.graph)  # the analyses write node.meta: put it back
    try:
        ctx = PassContext(gm, tuple(example_inputs))
        alias, live = ctx.analysis("alias"), ctx.analysis("liveness")
        order = ctx.analysis("topo")
        curve = [0] * (len(order) + 1)
        for storage, nodes in alias.nodes_of.items():
            if storage in alias.external:
                continue
            owner = min(nodes, key=order.__getitem__)
            nbytes = _storage_nbytes(owner, storage)
            if not isinstance(nbytes, int):
                return None
            interval = live.storages[storage]
            curve[interval.start] += nbytes
            curve[interval.end + 1] -= nbytes
    except (FxoptError, RuntimeError, KeyError):
        return None
    finally:
        snapshot.restore_meta()
    out, running = [], 0
    for delta in curve[:-1]:
        running += delta
        out.append(running)
    return out


def arena_bytes(gm: fx.GraphModule) -> int | None:
    """The arena of the memory plan ``plan_memory`` left on ``gm``, if any."""
    from fxopt.memory.plan import PLAN_KEY

    plan = gm.meta.get(PLAN_KEY)
    return int(plan.arena_bytes) if plan is not None else None
