"""After ``torch.compile``: which FX nodes each Inductor kernel computes, and its cost.

Inductor keeps the origins of every kernel it generates. With provenance tracking on
(``trace.provenance_tracking_level=1``) it publishes them, per compiled graph, as the
structured-trace artifact ``inductor_provenance_tracking_node_mappings`` that ``tlparse``
reads: ``cppCodeToPost`` (kernel -> post-grad nodes; CPU and GPU kernels alike) and
``postToPre`` (post-grad node -> the node of the graph Inductor was handed). Through the
``fxopt`` backend that graph is fxopt's torch-level graph, so the names are the user's
(rewritten) nodes. The artifact is captured here with a logging handler on the
structured-trace logger while the model compiles; no private Inductor state is read.

It measures a callable compiled elsewhere (:func:`profile_kernels`);
:func:`fxopt.profile_compiled` compiles a model with the ``fxopt`` backend and hands it in.

Costs come from torch.profiler: generated CPU kernels are profiler ranges when
``cpp.enable_kernel_profile`` is on (named ``graph_<i>_<kernel>``), Triton kernels are GPU
events under their own name, and extern kernels (``extern_kernels.mm``,
``torch.ops.mkldnn._convolution_pointwise``) are the ATen op of that name (with the GPU
kernels it launched). The FX graph cache is switched off for this compile: a cache hit
would skip the code generation that reports origins.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

from fxopt.errors import InputError
from fxopt.profiling.events import RUN_LABEL, is_device_activity

_ARTIFACT = "inductor_provenance_tracking_node_mappings"
_TRACE_LOGGER = "torch.__trace"


@dataclass
class KernelProfile:
    """One generated or extern kernel: the FX nodes it computes and its time per run."""

    name: str
    nodes: list[str]
    time_s: float = 0.0
    calls: int = 0
    share: float = 0.0


@dataclass
class CompiledProfile:
    """Kernels of a compiled model with their origins; see :func:`profile_compiled`."""

    kernels: list[KernelProfile]
    device: str
    runs: int
    #: end-to-end time of one compiled call under the profiler
    total_s: float
    #: the backend's record of each graph it compiled (fxopt.compile.backend.CompiledGraph)
    graphs: list[Any] = field(default_factory=list, repr=False)
    warnings: list[str] = field(default_factory=list)

    def by_node(self) -> dict[str, list[str]]:
        """FX node -> the kernels that compute (part of) it."""
        out: dict[str, list[str]] = {}
        for k in self.kernels:
            for node in k.nodes:
                out.setdefault(node, []).append(k.name)
        return out

    def rows(self) -> list[dict[str, Any]]:
        return [{"kernel": k.name, "nodes": " ".join(k.nodes), "time_ms": k.time_s * 1e3,
                 "share": k.share, "calls": k.calls} for k in self.kernels]

    def table(self, top: int = 20) -> str:
        rows = [[_clip(k.name, 40), f"{k.time_s * 1e3:.3f}", f"{100 * k.share:.1f}", k.calls,
                 _clip(", ".join(k.nodes), 40)] for k in self.kernels[:top]]
        head = (f"compiled on {self.device}: {len(self.kernels)} kernels, {self.runs} runs, "
                f"{self.total_s * 1e3:.3f} ms per call")
        text = tabulate(rows, headers=["kernel", "ms", "%", "calls", "FX nodes"], disable_numparse=True)
        return "\n".join([head, "", text, *(f"warning: {w}" for w in self.warnings)])

    def __str__(self) -> str:
        return self.table()


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


class _ArtifactCatcher(logging.Handler):
    """Collects the provenance artifacts Inductor emits through ``trace_structured`` in
    the thread that created it. torch emits them only through its structured-trace logger,
    a process-wide object: the handler sits there for the length of one compile, and
    ignores what compiles in other threads log meanwhile."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.payloads: list[dict[str, Any]] = []
        self.thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread:
            return
        metadata = getattr(record, "metadata", None)
        artifact = metadata.get("artifact") if isinstance(metadata, dict) else None
        if isinstance(artifact, dict) and artifact.get("name") == _ARTIFACT:
            try:
                self.payloads.append(json.loads(getattr(record, "payload", "") or "{}"))
            except json.JSONDecodeError:
                pass


def kernel_profile_options() -> dict[str, Any]:
    """The Inductor options a model must be compiled with for :func:`profile_kernels`: kernel
    ranges in the profiler for generated CPU code, the provenance artifact, and no FX graph
    cache (a cache hit would skip the code generation that reports origins)."""
    trace = torch._inductor.config.trace
    provenance = {"trace.provenance_tracking_level": 1} if hasattr(trace, "provenance_tracking_level") \
        else {"trace.provenance_tracking": True}  # torch versions before the level setting
    return {"cpp.enable_kernel_profile": True, "fx_graph_cache": False, **provenance}


def profile_kernels(compiled: Callable[..., Any], example_inputs: Sequence[Any], *,
                    graphs: list[Any] | None = None, warmup: int = 2, repeat: int = 5) -> CompiledProfile:
    """Run ``compiled``, a ``torch.compile``-d callable not yet called (its first call compiles,
    and that is when Inductor says where each kernel comes from), and attribute each kernel's
    time to the FX nodes it computes. Compile it with :func:`kernel_profile_options` among the
    Inductor options; ``graphs`` (the backend's records of what it compiled) are kept on the
    result. The compile path hands the callable in (:func:`fxopt.profile_compiled`), so
    profiling never imports the backend."""
    if not isinstance(example_inputs, (tuple, list)):
        raise InputError(f"example_inputs must be a tuple of inputs, got {type(example_inputs).__name__}")
    catcher = _ArtifactCatcher()
    trace_log = logging.getLogger(_TRACE_LOGGER)
    trace_log.addHandler(catcher)
    try:
        compiled(*example_inputs)
    finally:
        trace_log.removeHandler(catcher)
    kernels = _kernels(catcher.payloads)
    device = _device(example_inputs)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        compiled(*example_inputs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeat):
            with record_function(RUN_LABEL):
                compiled(*example_inputs)
                sync()
    result = _measure(kernels, prof.profiler.kineto_results.events(), repeat, device)
    result.graphs = graphs if graphs is not None else []
    if not catcher.payloads:
        result.warnings.append("Inductor published no kernel provenance (this torch may not "
                               "support trace.provenance_tracking); kernels have no FX nodes")
    return result


def _device(inputs: Sequence[Any]) -> str:
    for leaf in torch.utils._pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor):
            return str(leaf.device)
    return "cpu"


def _kernels(payloads: Iterable[dict[str, Any]]) -> dict[str, list[tuple[int, list[str]]]]:
    """Profiler name -> [(codegen order, FX nodes)] of every kernel in the artifacts."""
    out: dict[str, list[tuple[int, list[str]]]] = {}
    for payload in payloads:
        post_to_pre = payload.get("postToPre", {})
        for key, post_nodes in payload.get("cppCodeToPost", {}).items():
            name, _, handle = key.rpartition(":")
            if not name:
                name, handle = key, "0"
            nodes = list(dict.fromkeys(pre for post in post_nodes for pre in post_to_pre.get(post, [])))
            out.setdefault(_profiler_name(name), []).append((int(handle) if handle.isdigit() else 0, nodes))
    for entries in out.values():
        entries.sort(key=lambda e: e[0])
    return out


_EXTERN = re.compile(r"^(?:torch\.ops\.)?(\w+)\.(\w+)(?:\.\w+)?$")


def _profiler_name(kernel: str) -> str:
    """The name the profiler gives a kernel: generated kernels keep theirs, extern ones are
    the ATen op (``extern_kernels.mm`` -> ``aten::mm``, ``torch.ops.mkl._mkl_linear.default``
    -> ``mkl::_mkl_linear``)."""
    if kernel.startswith("extern_kernels."):
        return "aten::" + kernel.split(".", 1)[1]
    match = _EXTERN.match(kernel)
    if kernel.startswith("torch.ops.") and match:
        return f"{match.group(1)}::{match.group(2)}"
    return kernel


def _measure(kernels: dict[str, list[tuple[int, list[str]]]], events: Sequence[Any], runs: int,
             device: str) -> CompiledProfile:
    events = sorted(events, key=lambda e: e.start_ns())
    on_gpu = device.startswith("cuda")
    run_ranges = [(e.start_ns(), e.end_ns()) for e in events if e.name() == RUN_LABEL]
    device_time: dict[int, float] = {}  # correlation id of the launching CPU op -> GPU seconds
    for e in events:
        if is_device_activity(e):
            corr = e.linked_correlation_id()
            device_time[corr] = device_time.get(corr, 0.0) + (e.end_ns() - e.start_ns()) * 1e-9
    found: dict[tuple[str, int], KernelProfile] = {}
    seen_in_run: dict[tuple[str, int], int] = {}
    for e in events:
        if e.device_type() != DeviceType.CPU or e.name() == RUN_LABEL:
            continue
        name = _match(e.name(), kernels, on_gpu)
        if name is None:
            continue
        run = next((i for i, (s, t) in enumerate(run_ranges) if s <= e.start_ns() <= t), None)
        if run is None:
            continue
        entries = kernels[name]
        k = seen_in_run.get((name, run), 0)
        seen_in_run[(name, run)] = k + 1
        handle, nodes = entries[k % len(entries)]
        profile = found.setdefault((name, handle), KernelProfile(name, nodes))
        profile.calls += 1
        cost = device_time.get(e.correlation_id(), 0.0) if on_gpu else (e.end_ns() - e.start_ns()) * 1e-9
        profile.time_s += cost
    if on_gpu:  # Triton kernels: GPU events under their own name
        for e in events:
            if is_device_activity(e) and e.name() in kernels:
                handle, nodes = kernels[e.name()][0]
                profile = found.setdefault((e.name(), handle), KernelProfile(e.name(), nodes))
                profile.calls += 1
                profile.time_s += (e.end_ns() - e.start_ns()) * 1e-9
    result = sorted(found.values(), key=lambda k: k.time_s, reverse=True)
    for k in result:
        k.time_s /= runs
        k.calls //= runs
    total = sum(k.time_s for k in result)
    for k in result:
        k.share = k.time_s / total if total else 0.0
    wall = statistics.fmean((t - s) * 1e-9 for s, t in run_ranges) if run_ranges else 0.0
    return CompiledProfile(result, device, runs, wall)


def _match(event_name: str, kernels: dict[str, Any], on_gpu: bool) -> str | None:
    """The kernel a CPU-side profiler event stands for (generated CPU kernels are ranges
    ``graph_<i>_<kernel>``; extern kernels are their ATen op)."""
    if event_name in kernels and not (on_gpu and event_name.startswith("triton")):
        return event_name
    match = re.match(r"^graph_\d+_(.+)$", event_name)
    if match and match.group(1) in kernels:
        return match.group(1)
    return None
