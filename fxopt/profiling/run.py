"""``fxopt.profile``: run a GraphModule node by node under torch.profiler.

The graph runs in an :class:`fx.Interpreter` that wraps every node in
``record_function("fxopt::<node>")``; the profiler's own events (CPU ops, GPU kernels,
allocator events) are then mapped back to the node whose range they fall in
(:mod:`fxopt.profiling.events`). FLOPs come from ``torch.utils.flop_counter`` during the
first warm-up run, one counter per node.

Side effects. Each run is one eager call of the graph: a train-mode BatchNorm advances
its running statistics, a dropout draws random numbers. ``profile`` undoes all of that
when it is done: parameters and buffers written in place are copied back from a snapshot
(the pass manager's :class:`fxopt.snapshot.TensorGuard`), inputs written in
place are restored before every run (so each run sees the same inputs), and the global
RNG state is forked. The caller's module, inputs and RNG end as they were.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, record_function
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from fxopt.errors import InputError, ProfileError, TraceError
from fxopt.profiling.events import NODE_PREFIX, RUN_LABEL, parse_runs
from fxopt.profiling.kinds import node_kind
from fxopt.profiling.memory import arena_bytes, predicted_live_bytes
from fxopt.profiling.result import NodeProfile, Profile, share_of
from fxopt.snapshot import TensorGuard
from fxopt.snapshot import _tensors as module_tensors


class _LabelledInterpreter(fx.Interpreter):
    """Runs each node inside a profiler range named after it; errors name the node."""

    def __init__(self, gm: fx.GraphModule, flops: dict[str, int | None] | None = None):
        super().__init__(gm)
        self.flops = flops

    def run_node(self, n: fx.Node) -> Any:
        with record_function(NODE_PREFIX + n.name):
            try:
                if self.flops is None:
                    return super().run_node(n)
                with FlopCounterMode(display=False) as counter:
                    result = super().run_node(n)
                self.flops[n.name] = counter.get_total_flops() or None
                return result
            except ProfileError:
                raise
            except Exception as exc:
                raise ProfileError(f"{type(exc).__name__}: {exc}", node=n.name) from exc


class _StateGuard:
    """Puts parameters, buffers and inputs back as they were (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, inputs: tuple[Any, ...], backup_limit: int):
        self.tensors = TensorGuard(gm, backup_limit)
        self.inputs = [(t, t._version, t.detach().clone()) for t in inputs
                       if isinstance(t, torch.Tensor) and not t.is_inference()]
        self.warnings: list[str] = []

    def restore_inputs(self) -> None:
        with torch.no_grad():
            for t, version, saved in self.inputs:
                if t._version != version:
                    t.copy_(saved)

    def restore(self) -> None:
        self.restore_inputs()
        changed = self.tensors.changed()
        if changed and not self.tensors.restore():
            self.warnings.append(
                f"the graph writes {', '.join(changed)} in place; the module was too large to "
                "snapshot (backup_limit), so they hold the values of the last profiled run")


def profile(
    gm: fx.GraphModule | torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    device: str | torch.device | None = None,
    warmup: int = 2,
    repeat: int = 5,
    record_shapes: bool = False,
    backup_limit: int = 1 << 30,
) -> Profile:
    """Measure every node of ``gm`` on ``example_inputs``: time, memory, FLOPs.

    ``gm`` is a GraphModule, an ``ExportedProgram`` or an ``nn.Module``: traced with
    ``fx.symbolic_trace``, or, where that fails (models with shape-dependent branches,
    Hugging Face transformers), exported with ``torch.export`` on ``example_inputs``. ``device`` (default: where the inputs are) is where the
    graph runs; a model or inputs elsewhere are copied there, the caller's stay put. The
    graph runs ``warmup`` times (the first also counts FLOPs), then ``repeat`` times
    under the profiler; times are means over those runs. A plain ``gm(*inputs)`` is also
    timed ``repeat`` times, so ``Profile.eager_s`` vs ``Profile.total_s`` is the overhead.

    Raises :class:`~fxopt.errors.ProfileError` naming the node where the graph fails on
    the inputs, :class:`~fxopt.errors.InputError` for inputs that are not a tuple/list.
    """
    if not isinstance(example_inputs, (tuple, list)):
        raise InputError(f"example_inputs must be a tuple of inputs, got {type(example_inputs).__name__}")
    if warmup < 0 or repeat < 1:
        raise InputError(f"warmup must be >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}")
    inputs = tuple(example_inputs)
    gm = _capture(gm, inputs)
    dev = torch.device(device) if device is not None else _device_of(inputs, gm)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device='cuda' but torch.cuda.is_available() is false")
    if any(t.device != dev for t in _tensors(gm, inputs)):
        gm = copy.deepcopy(gm).to(dev)
        inputs = tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, inputs)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    names = [n.name for n in gm.graph.nodes]
    guard = _StateGuard(gm, inputs, backup_limit)
    flops: dict[str, int | None] = {}
    rng_devices = [dev] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            _LabelledInterpreter(gm, flops).run(*inputs)
            sync()
            guard.restore_inputs()
            for _ in range(max(warmup - 1, 0)):
                _LabelledInterpreter(gm).run(*inputs)
                guard.restore_inputs()
            eager = _time_eager(gm, inputs, repeat, sync, guard.restore_inputs)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with torch.profiler.profile(activities=activities, profile_memory=True,
                                        record_shapes=record_shapes) as prof:
                for _ in range(repeat):
                    with record_function(RUN_LABEL):
                        out = _LabelledInterpreter(gm).run(*inputs)
                        sync()
                    del out  # after the run: the caller would hold the outputs
                    guard.restore_inputs()
        # inside the guard: the shapes analysis's fake run of a train-mode BatchNorm module
        # still increments its real num_batches_tracked
        predicted = predicted_live_bytes(gm, inputs)
    finally:
        guard.restore()
    runs = parse_runs(prof.profiler.kineto_results.events(), names, dev.type)
    result = _assemble(gm, runs, dev, flops, eager)
    result.warnings += guard.warnings
    result.profiler = prof
    result.predicted_bytes = predicted
    result.arena_bytes = arena_bytes(gm)
    return result


def _capture(model: Any, inputs: tuple[Any, ...]) -> fx.GraphModule:
    """A GraphModule of ``model``: symbolic_trace first (it keeps the module structure),
    then torch.export, which follows what symbolic_trace cannot when given the inputs.
    Both share the model's parameters and buffers."""
    from fxopt.optimize import as_graph_module

    try:
        return as_graph_module(model)
    except TraceError as trace_error:
        try:
            return torch.export.export(model, inputs, strict=False).module()
        except Exception as exc:
            raise TraceError(f"{trace_error}\ntorch.export.export failed too: {type(exc).__name__}: "
                             f"{exc}") from exc


def _tensors(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(inputs)
    return [t for t in leaves if isinstance(t, torch.Tensor)] + [t for _, t in module_tensors(gm)]


def _device_of(inputs: tuple[Any, ...], gm: fx.GraphModule) -> torch.device:
    tensors = _tensors(gm, inputs)
    return tensors[0].device if tensors else torch.device("cpu")


def _time_eager(gm: fx.GraphModule, inputs: tuple[Any, ...], repeat: int, sync: Callable[[], None],
                restore: Callable[[], None]) -> float:
    """Median wall time of a plain call (the generated code, no profiler, no interpreter)."""
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        gm(*inputs)
        sync()
        times.append(time.perf_counter() - start)
        restore()
    return statistics.median(times)


def _assemble(gm: fx.GraphModule, runs: list, dev: torch.device, flops: dict[str, int | None],
              eager: float) -> Profile:
    from fxopt.visualize.graph import module_path

    on_gpu = dev.type == "cuda"
    last = runs[-1]
    nodes = []
    for node in gm.graph.nodes:
        figs = [r.nodes[node.name] for r in runs]
        cpu = statistics.fmean(f.cpu_s for f in figs)
        device_s = statistics.fmean(f.device_s for f in figs)
        mem = last.nodes[node.name]
        nodes.append(NodeProfile(
            name=node.name, op=node.op, target=_target_text(node),
            kind=node_kind(mem.ops) if node.op not in ("placeholder", "output", "get_attr") else "other",
            module=".".join(module_path(node)), time_s=device_s if on_gpu else cpu, cpu_time_s=cpu,
            device_time_s=device_s, flops=flops.get(node.name), allocated_bytes=mem.allocated,
            freed_bytes=mem.freed, live_bytes=mem.live_after, peak_bytes=mem.peak, ops=list(mem.ops),
            kernels=list(dict.fromkeys(mem.kernels)),
        ))
    for n, share in zip(nodes, share_of([n.time_s for n in nodes])):
        n.share = share
    total = statistics.fmean(r.wall_s for r in runs)
    return Profile(nodes=nodes, device=str(dev), runs=len(runs), total_s=total, eager_s=eager,
                   peak_bytes=max((n.peak_bytes for n in nodes), default=0), graph_module=gm)


def _target_text(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)
