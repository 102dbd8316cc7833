"""From torch.profiler's raw events to per-node figures.

Every node runs inside a ``record_function("fxopt::<node>")`` range and every run inside
``record_function("fxopt.run")``. The raw (Kineto) events share one clock, in ns:

* a node's *slot* runs from the start of its range to the start of the next node's (the
  last one to the end of the run), so the frees the interpreter does right after a node
  (values it was the last user of) belong to that node;
* CPU ops nested directly in a node's range are its top-level ops (their names give its
  kind);
* a GPU kernel, memcpy or memset belongs to the node whose slot holds the CPU op that
  launched it (Kineto's ``linked_correlation_id`` names that op);
* a ``[memory]`` event on the profiled device belongs to the slot it falls in; their
  running sum from the start of a run is the live-memory curve.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.autograd import DeviceType

NODE_PREFIX = "fxopt::"
RUN_LABEL = "fxopt.run"


# What sort of event it is, from methods every supported torch has (``activity_type()`` is
# newer than torch 2.11). Kineto links a GPU activity and a CUDA runtime call to the CPU op
# that launched it (``linked_correlation_id``); a CPU op itself links to nothing.
def is_user_range(e: Any) -> bool:
    """A ``record_function`` range on the CPU (a node's or a run's)."""
    return e.device_type() == DeviceType.CPU and e.is_user_annotation()


def is_cpu_op(e: Any) -> bool:
    """An operator the CPU ran: not a user range, a runtime call or an allocator event."""
    return (e.device_type() == DeviceType.CPU and not e.is_user_annotation()
            and e.linked_correlation_id() == 0 and e.name() != "[memory]")


def is_device_activity(e: Any) -> bool:
    """A GPU kernel, memcpy or memset (not the GPU-side copy of a user range)."""
    return (e.device_type() != DeviceType.CPU and not e.is_user_annotation()
            and e.name() != "[memory]" and not e.name().startswith((NODE_PREFIX, RUN_LABEL)))


@dataclass
class NodeFigures:
    """What one run measured for one node (seconds, bytes)."""

    cpu_s: float = 0.0
    device_s: float = 0.0
    allocated: int = 0
    freed: int = 0
    live_after: int = 0
    peak: int = 0
    ops: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)


@dataclass
class RunFigures:
    wall_s: float
    device_span_s: float
    nodes: dict[str, NodeFigures]


def parse_runs(events: Sequence[Any], node_names: Sequence[str], device: str) -> list[RunFigures]:
    """Split the raw events of a profiling session into runs and attribute them to nodes."""
    events = sorted(events, key=lambda e: e.start_ns())
    runs = [e for e in events if e.name() == RUN_LABEL]
    if not runs:
        raise RuntimeError("the profiler recorded no fxopt.run range (was it started?)")
    starts = [r.start_ns() for r in runs]
    per_run: list[list[Any]] = [[] for _ in runs]
    for e in events:
        i = bisect.bisect_right(starts, e.start_ns()) - 1
        if i >= 0 and e.name() != RUN_LABEL:
            per_run[i].append(e)
    # kernels run after their launch, possibly after the run range closed on the CPU: a GPU
    # event goes to the run of the CPU op that launched it
    launchers = {e.correlation_id(): e for e in events if is_cpu_op(e)}
    memory_device = DeviceType.CUDA if device.startswith("cuda") else DeviceType.CPU
    return [_one_run(run, evs, node_names, launchers, memory_device) for run, evs in zip(runs, per_run)]


def _one_run(run: Any, events: list[Any], node_names: Sequence[str], launchers: dict[int, Any],
             memory_device: DeviceType) -> RunFigures:
    ranges = [e for e in events if e.name().startswith(NODE_PREFIX) and is_user_range(e)]
    known = set(node_names)
    ranges = [e for e in ranges if e.name()[len(NODE_PREFIX):] in known]
    starts = [e.start_ns() for e in ranges]
    figures = {name: NodeFigures() for name in node_names}
    slot_of = [figures[e.name()[len(NODE_PREFIX):]] for e in ranges]

    def slot(t: int) -> NodeFigures | None:
        i = bisect.bisect_right(starts, t) - 1
        return slot_of[i] if i >= 0 else None

    for e, fig in zip(ranges, slot_of):
        fig.cpu_s += (e.end_ns() - e.start_ns()) * 1e-9
    _top_level_ops(events, ranges, slot_of)
    first_kernel, last_kernel = None, None
    for e in events:
        if not is_device_activity(e):
            continue
        launcher = launchers.get(e.linked_correlation_id())
        fig = slot(launcher.start_ns()) if launcher is not None else None
        if fig is not None:
            fig.device_s += (e.end_ns() - e.start_ns()) * 1e-9
            fig.kernels.append(e.name())
            first_kernel = e.start_ns() if first_kernel is None else min(first_kernel, e.start_ns())
            last_kernel = e.end_ns() if last_kernel is None else max(last_kernel, e.end_ns())
    live = 0
    current = None
    for e in events:
        if e.name() != "[memory]" or e.device_type() != memory_device or e.start_ns() > run.end_ns():
            continue
        fig = slot(e.start_ns())
        if fig is None:
            continue
        if fig is not current:
            current, fig.peak = fig, max(fig.peak, live)
        nbytes = e.nbytes()
        live += nbytes
        if nbytes > 0:
            fig.allocated += nbytes
        else:
            fig.freed -= nbytes
        fig.peak = max(fig.peak, live)
    live = 0
    for fig in slot_of:  # live after each node, carried over nodes that allocate nothing
        live += fig.allocated - fig.freed
        fig.live_after = live
        fig.peak = max(fig.peak, live)
    span = (last_kernel - first_kernel) * 1e-9 if first_kernel is not None else 0.0
    return RunFigures((run.end_ns() - run.start_ns()) * 1e-9, span, figures)


def _top_level_ops(events: list[Any], ranges: list[Any], slot_of: list[NodeFigures]) -> None:
    """Append to each node the names of the CPU ops directly inside its range."""
    ops = [e for e in events if is_cpu_op(e)]
    i = 0
    for node_range, fig in zip(ranges, slot_of):
        end_of_open = -1
        while i < len(ops) and ops[i].start_ns() < node_range.start_ns():
            i += 1
        while i < len(ops) and ops[i].start_ns() <= node_range.end_ns():
            op = ops[i]
            if op.start_ns() >= end_of_open:  # not nested in the previous top-level op
                fig.ops.append(op.name())
                end_of_open = op.end_ns()
            i += 1
