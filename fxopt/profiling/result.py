"""What a profile holds: per-node time, memory and FLOPs, and the tables built from them.

A :class:`Profile` is plain data (its rows are dicts; ``to_csv`` writes them), so it can be
compared, saved and printed without pandas. Times are means over the profiled runs; the
memory figures come from the last profiled run (allocations repeat run to run).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from fxopt.profiling.diff import ProfileDiff, diff_profiles
from fxopt.profiling.kinds import KINDS

if TYPE_CHECKING:
    import torch.fx as fx

_MIB = 1 << 20


@dataclass
class NodeProfile:
    """One node's measured cost (times in seconds per run, memory in bytes)."""

    name: str
    #: the fx op (``call_function``, ``call_module``...) and its target, as text
    op: str
    target: str
    #: what sort of work it does, one of :data:`fxopt.profiling.kinds.KINDS`
    kind: str
    #: the submodule it belongs to (dotted), "" at the top level
    module: str
    #: the time that ranks it: kernel time on a GPU, wall time of its range on the CPU
    time_s: float = 0.0
    #: wall time of its ``record_function`` range on the CPU (launch time on a GPU)
    cpu_time_s: float = 0.0
    #: time of the GPU kernels, copies and memsets it launched (0 on the CPU)
    device_time_s: float = 0.0
    #: share of the sum of all nodes' ``time_s``
    share: float = 0.0
    #: from torch.utils.flop_counter; None where it knows none of the node's ops
    flops: int | None = None
    #: bytes allocated and freed while it ran (frees of values it was the last user of
    #: included), the live bytes after it, and the highest live bytes while it ran;
    #: all relative to the start of the run (inputs and parameters excluded)
    allocated_bytes: int = 0
    freed_bytes: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0
    #: the top-level ATen ops it ran (CPU) and the kernels it launched (GPU)
    ops: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        """This node as a flat dict (one CSV row)."""
        return {
            "node": self.name, "op": self.op, "target": self.target, "kind": self.kind,
            "module": self.module, "time_ms": self.time_s * 1e3, "cpu_ms": self.cpu_time_s * 1e3,
            "device_ms": self.device_time_s * 1e3, "share": self.share, "flops": self.flops,
            "allocated_bytes": self.allocated_bytes, "freed_bytes": self.freed_bytes,
            "live_bytes": self.live_bytes, "peak_bytes": self.peak_bytes,
            "ops": " ".join(self.ops), "kernels": " ".join(self.kernels),
        }


@dataclass
class Profile:
    """The result of :func:`fxopt.profile`: per-node cost of one GraphModule on one device.

    ``total_s`` is the end-to-end time of one run under the profiler, ``eager_s`` that of
    a plain ``gm(*inputs)`` call timed separately (the difference is the profiling
    overhead); ``node_time_s`` is the sum of the nodes' ``time_s``.
    """

    nodes: list[NodeProfile]
    device: str
    runs: int
    total_s: float
    eager_s: float
    peak_bytes: int
    #: live bytes predicted by the liveness analysis after each node (None if shapes
    #: could not be propagated), and the arena of a ``plan_memory`` plan if the graph has one
    predicted_bytes: list[int] | None = None
    arena_bytes: int | None = None
    warnings: list[str] = field(default_factory=list)
    #: the profiled graph (for the heat map) and the torch profiler (for the trace)
    graph_module: fx.GraphModule | None = field(default=None, repr=False, compare=False)
    profiler: Any = field(default=None, repr=False, compare=False)

    # --- lookups ------------------------------------------------------------------

    def __getitem__(self, name: str) -> NodeProfile:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in this profile")

    @property
    def node_time_s(self) -> float:
        return sum(n.time_s for n in self.nodes)

    @property
    def total_flops(self) -> int:
        return sum(n.flops or 0 for n in self.nodes)

    def curve(self) -> list[tuple[str, int, int]]:
        """The live-memory curve over the node order: (node, live after, peak during)."""
        return [(n.name, n.live_bytes, n.peak_bytes) for n in self.nodes]

    def overlay(self, metric: str = "time") -> dict[str, float]:
        """Node name -> percent of the total ``time`` or of the bytes ``memory`` allocated,
        for ``fxopt.visualize.render(gm, overlay=...)``."""
        if metric == "time":
            return {n.name: 100 * n.share for n in self.nodes}
        if metric == "memory":
            total = sum(n.allocated_bytes for n in self.nodes) or 1
            return {n.name: 100 * n.allocated_bytes / total for n in self.nodes}
        raise ValueError(f"overlay metric must be 'time' or 'memory', got {metric!r}")

    # --- tables ----------------------------------------------------------------------

    def hotspots(self, top: int | None = None) -> list[dict[str, Any]]:
        """Node rows (see :meth:`NodeProfile.row`), most expensive first."""
        ranked = sorted(self.nodes, key=lambda n: n.time_s, reverse=True)
        return [n.row() for n in ranked[:top]]

    def by_kind(self) -> list[dict[str, Any]]:
        """One row per op kind: time, share, node count, FLOPs and bytes allocated."""
        rows: dict[str, dict[str, Any]] = {}
        for n in self.nodes:
            row = rows.setdefault(n.kind, {"kind": n.kind, "nodes": 0, "time_ms": 0.0, "share": 0.0,
                                           "flops": 0, "allocated_bytes": 0})
            row["nodes"] += 1
            row["time_ms"] += n.time_s * 1e3
            row["share"] += n.share
            row["flops"] += n.flops or 0
            row["allocated_bytes"] += n.allocated_bytes
        return sorted(rows.values(), key=lambda r: (-r["time_ms"], KINDS.index(r["kind"])))

    def to_csv(self, path: str | os.PathLike | None = None, *, by: str = "node") -> str:
        """The node rows (``by="node"``, graph order) or kind rows (``by="kind"``) as CSV;
        written to ``path`` when given. Returns the text."""
        rows = [n.row() for n in self.nodes] if by == "node" else self.by_kind()
        if by not in ("node", "kind"):
            raise ValueError(f"by must be 'node' or 'kind', got {by!r}")
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["node"])
        writer.writeheader()
        writer.writerows(rows)
        if path is not None:
            Path(path).write_text(out.getvalue(), encoding="utf-8")
        return out.getvalue()

    def table(self, top: int = 20) -> str:
        """The printable summary: totals, the ``top`` nodes and the kinds (<= 100 columns)."""
        rows = []
        for rank, r in enumerate(self.hotspots(top), 1):
            rows.append([rank, _clip(r["node"], 26), r["kind"], _clip(r["module"], 14, keep_end=True),
                         f"{r['time_ms']:.3f}", f"{100 * r['share']:.1f}", _gflop(r["flops"]),
                         f"{r['allocated_bytes'] / _MIB:.1f}", f"{r['peak_bytes'] / _MIB:.1f}"])
        nodes = tabulate(rows, headers=["#", "node", "kind", "module", "ms", "%", "GFLOP", "alloc",
                                        "peak"], disable_numparse=True)
        kinds = tabulate([[r["kind"], r["nodes"], f"{r['time_ms']:.3f}", f"{100 * r['share']:.1f}",
                           _gflop(r["flops"] or None), f"{r['allocated_bytes'] / _MIB:.1f}"]
                          for r in self.by_kind()],
                         headers=["kind", "nodes", "ms", "%", "GFLOP", "alloc"], disable_numparse=True)
        what = "GPU kernel time" if self.device.startswith("cuda") else "CPU time"
        head = (f"profile on {self.device}: {len(self.nodes)} nodes, {self.runs} runs, "
                f"peak {self.peak_bytes / _MIB:.1f} MiB live\nper run: nodes {self.node_time_s * 1e3:.3f} "
                f"ms ({what}), end to end {self.total_s * 1e3:.3f} ms profiled, "
                f"{self.eager_s * 1e3:.3f} ms plain\nalloc: MiB allocated by the node; peak: MiB live "
                "while it ran (both from the start of the run)")
        lines = [head, "", nodes, "", kinds]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # --- before/after and export -------------------------------------------------------

    def diff(self, other: Profile, report: Any = None) -> ProfileDiff[Profile]:
        """What changed from this profile (before) to ``other`` (after a rewrite),
        attributed to passes and the nodes they rewrote (see :class:`ProfileDiff`)."""
        return diff_profiles(self, other, report)

    def export_chrome_trace(self, path: str | os.PathLike) -> Path:
        """Write the profiled runs as a Chrome/Perfetto trace; each node is a slice
        ``fxopt::<node name>`` with its ATen ops (and GPU kernels) under it."""
        if self.profiler is None:
            raise ValueError("this profile keeps no profiler trace (it was loaded or built by hand)")
        self.profiler.export_chrome_trace(str(path))
        return Path(path)


def _clip(text: str, width: int, keep_end: bool = False) -> str:
    if len(text) <= width:
        return text
    return "…" + text[1 - width:] if keep_end else text[: width - 1] + "…"


def _gflop(flops: int | None) -> str:
    return "" if not flops else f"{flops / 1e9:.3f}"


def share_of(values: Sequence[float]) -> list[float]:
    total = sum(values)
    return [v / total if total else 0.0 for v in values]
