"""The ``fxopt`` Dynamo backend: fxopt passes over each graph Dynamo captures, then Inductor.

``torch.compile(model, backend="fxopt", options={...})`` (or :func:`fxopt.compile`) runs fxopt
passes over every graph Dynamo captures, then hands the result to Inductor's
``compile_fx``. Two levels, as DESIGN.md describes:

* **torch level** (``passes``): the Dynamo graph itself, before AOTAutograd. This is where
  conv-BN folding and quantization see ``torch.conv2d`` / ``F.batch_norm`` calls.
* **ATen level** (``post_grad_pre_passes`` and friends): fxopt pipelines installed as
  Inductor custom passes (:mod:`fxopt.compile.inductor_pass`), so the FX graph cache and
  the AOTAutograd cache keep working.

Freezing (:mod:`fxopt.compile.freezing`). The weights of inference graphs become
constants. After the user's passes, the layout passes of :mod:`fxopt.passes.layout` prepare
the half-precision CUDA convolutions for cuDNN's tensor cores (channels-last weights, as
Inductor's freezing does for the convolutions it sees, and RGB stems padded to 8 channels).
On every inference graph (training graphs too with ``sdpa_in_training=True``), attention
whose sizes are symbolic calls ``F.scaled_dot_product_attention`` at run time
(:mod:`fxopt.compile.attention`: Inductor would compile the fp32 math fallback). Training graphs are never frozen and inference-only
passes are skipped on them, with a line in the report.

CUDA graphs. A compiled inference graph whose replay the caller could not tell from a
plain call (see :mod:`fxopt.compile.replay`) is replayed as CUDA graphs, one per call shape (at
most ``replay_shapes``), from the second call of each shape on: on conv nets, plain
launches are bound by host time, which fusing kernels does not cut. ``cuda_graphs=False``
turns it off; ``CompiledGraph.no_replay`` says why a graph is not replayed at all, and
``CompiledGraph.replay`` what ran for each shape.

Failure policy. Options are checked before anything compiles (:mod:`fxopt.compile.options`).
A pass that fails on a graph does not break the user's ``torch.compile``: that graph is
compiled by plain Inductor and a warning names the pass; ``strict=True`` raises instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fxopt.compile.attention import DeferSdpaChoice
from fxopt.compile.freezing import (
    FreezeParameters,
    FrozenWeights,
    is_weight,
    sync_dynamo_metadata,
    traced_frozen,
    work_copy,
)
from fxopt.compile.inductor_pass import warn_fallback
from fxopt.compile.options import BackendOptions
from fxopt.compile.replay import GraphReplay, ReplayLog
from fxopt.compile.replay import refusal as replay_refusal
from fxopt.compile.training import PlainOutputs, fresh_outputs, inductor_skips, training_route
from fxopt.compile.training import refusal as training_refusal
from fxopt.errors import FxoptError, PassError
from fxopt.manager import PassManager, VerifyEach
from fxopt.passes.group_width import PadGroupWidth
from fxopt.passes.layout import ChannelsLastWeights, PadConvChannels
from fxopt.pipeline import resolve
from fxopt.report import Report

__all__ = ["CompiledGraph", "fxopt_backend", "is_training"]


@dataclass
class CompiledGraph:
    """What the backend did with one Dynamo graph."""

    name: str
    training: bool
    #: names of the placeholders turned into constants
    frozen: list[str]
    #: the torch-level report (None when the graph fell back before passes ran)
    report: Report | None
    #: the Python code of the torch-level graph handed to Inductor (None on fallback)
    code: str | None = None
    #: why this graph was compiled by plain Inductor, or None
    fallback: str | None = None
    #: (Inductor hook, report) of every ATen-level pipeline run for this graph
    aten_reports: list[tuple[str, Report]] = field(default_factory=list)
    #: why the compiled graph is never replayed as a CUDA graph (set at compile time), or None
    no_replay: str | None = None
    #: when it may be: what ran for each call shape and why (replayed, plain and why,
    #: evictions, calls beyond the bound), updated as calls come
    replay: ReplayLog | None = None
    #: what ``memory_budget`` did to the graph (fxopt.memory.budget.BudgetDecision, one per
    #: forward/backward partition)
    memory: list[Any] = field(default_factory=list)


def fxopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                  options: Mapping[str, Any] | None = None, mode: str | None = None) -> Callable:
    """The Dynamo backend registered as ``"fxopt"``: fxopt passes, then Inductor."""
    return _compile_graph(gm, list(example_inputs), BackendOptions.parse(options, mode))


def is_training(example_inputs: Sequence[Any]) -> bool:
    """A graph is trained when autograd is on and some input requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def _compile_graph(gm: fx.GraphModule, example_inputs: list[Any], opts: BackendOptions) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    training = is_training(example_inputs)
    name = str(gm.meta.get("dynamo_compile_id", type(gm).__name__))
    try:
        work = work_copy(gm)
        # a run of its own: verification needs the inputs the frozen graph still takes
        freezing = PassManager([FreezeParameters(example_inputs)] if opts.freeze else []).run(
            work, training=training).records
        frozen = [name for r in freezing for name in r.stats.get("frozen", [])]
        keep = next((r.stats["inputs_kept"] for r in freezing if r.changed), list(range(len(example_inputs))))
        hooks = [VerifyEach(work, [example_inputs[i] for i in keep])] if opts.verify else []
        passes = resolve(opts.pipeline("passes") or [])
        constant = bool(frozen) or (opts.freeze and traced_frozen(work, training))
        if constant:  # constant weights: lay convolutions out for cuDNN's tensor cores
            passes += [PadConvChannels(), PadGroupWidth(), ChannelsLastWeights()]
        if not training or opts.sdpa_in_training:  # Inductor cannot choose a fused kernel for symbolic sizes
            passes.append(DeferSdpaChoice())
        report = PassManager(passes, hooks=hooks).run(work, training=training)
        report.records[:0] = freezing
        if opts.memory_budget is not None and not training:
            report.warnings.append("memory_budget does not apply: an inference graph (autograd off or no input "
                                   "requiring grad) saves nothing for a backward")
        sync_dynamo_metadata(work)
    except Exception as exc:
        if opts.strict:
            raise
        return _fallback(gm, example_inputs, opts, training, name, exc)
    record = CompiledGraph(name, training, frozen, report, work.code)
    patches = opts.inductor_patches(frozen=constant, training=training, sink=record.aten_reports,
                                    budget_sink=record.memory)
    kept = [example_inputs[i] for i in keep]
    step = _training_step_replay(work, kept, training, opts, patches, record)
    try:
        with inductor_skips() as skips:
            compiled = compile_fx(work, kept, config_patches=patches)
    except Exception as exc:
        # Dynamo's request to trace the frame again (e.g. to specialize a float that a
        # dynamic size divides) is no failure: the backend is called anew
        if opts.strict or isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            raise
        if opts.reports is not None:
            opts.reports.append(record)
        changed = [r.name for _, r in report.walk() if r.changed and not r.children]
        reason = f"Inductor failed on the rewritten graph (passes that changed it: {changed}): " \
                 f"{type(exc).__name__}: {exc}"
        record.fallback = reason
        warn_fallback(name, reason)
        return _plain_inductor(gm, example_inputs, opts, training)
    if opts.reports is not None:
        opts.reports.append(record)
    if step:
        if skips:
            record.no_replay = f"Inductor gave up its CUDA graphs: {'; '.join(skips)}"
        compiled = PlainOutputs(compiled, fresh_outputs(work))
    else:
        if record.no_replay is None:
            record.no_replay = _no_replay(work, kept, training, opts, patches)
        if record.no_replay is None:
            compiled = GraphReplay(compiled, max_shapes=opts.replay_shapes)
            record.replay = compiled.log
    if len(keep) == len(example_inputs):
        return compiled
    # a graph of a training step (an optimizer's update) may freeze what it only reads, too
    weights = [example_inputs[i] for i in range(len(example_inputs)) if i not in set(keep)]
    return FrozenWeights(compiled, keep, weights, lambda args: _unfrozen(gm, args, opts, record, training))


def _training_step_replay(work: fx.GraphModule, inputs: list[Any], training: bool, opts: BackendOptions,
                          patches: dict[str, Any], record: CompiledGraph) -> bool:
    """Whether ``work`` is replayed as part of a training step (fxopt.compile.training): then
    Inductor's CUDA-graph trees are switched on in ``patches``. A training-step graph that
    is refused gets the reason in ``record.no_replay``."""
    placeholders = list(work.graph.find_nodes(op="placeholder"))
    state = {node for node, value in zip(placeholders, inputs) if is_weight(node, value)}
    if not training_route(work, training=training, is_state=state.__contains__):
        return False
    if not opts.cuda_graphs or opts.training_cuda_graphs is False:
        record.no_replay = "cuda_graphs=False" if not opts.cuda_graphs else "training_cuda_graphs=False"
        return False
    if patches.get("triton.cudagraphs"):
        record.no_replay = "Inductor captures its own CUDA graphs (mode='reduce-overhead')"
    elif any(_from_fsdp(getattr(n, "_dynamo_source", None)) for n in placeholders):
        record.no_replay = ("parameters of an FSDP-managed module: FSDP re-allocates them every step, so "
                            "a replay copies or re-records them (0.26-0.43x Inductor on 2 H200s)")
    else:
        record.no_replay = training_refusal(work, inputs, is_state=state.__contains__)
    if record.no_replay is not None:
        if opts.training_cuda_graphs:  # asked for by name: say why it does not apply
            warnings.warn(f"fxopt backend: training_cuda_graphs=True does not apply to graph {record.name}: "
                          f"{record.no_replay}; it runs with plain launches", RuntimeWarning, stacklevel=2)
        return False
    patches["triton.cudagraphs"] = True
    return True


def _from_fsdp(source: Any) -> bool:
    """Whether a Dynamo source reaches its tensor through an FSDP-managed module."""
    try:
        from torch._dynamo.source import FSDPNNModuleSource
    except ImportError:  # pragma: no cover
        return False
    while source is not None:
        if isinstance(source, FSDPNNModuleSource):
            return True
        source = getattr(source, "base", None)
    return False


def _no_replay(work: fx.GraphModule, inputs: list[Any], training: bool, opts: BackendOptions,
               patches: Mapping[str, Any]) -> str | None:
    if not opts.cuda_graphs:
        return "cuda_graphs=False"
    if patches.get("triton.cudagraphs"):
        return "Inductor captures its own CUDA graphs (mode='reduce-overhead')"
    return replay_refusal(work, inputs, training=training)


def _fallback(gm: fx.GraphModule, example_inputs: list[Any], opts: BackendOptions, training: bool,
              name: str, exc: Exception) -> Callable:
    culprit = f"pass {exc.pass_name!r}" if isinstance(exc, PassError) else "fxopt"
    reason = f"{culprit} failed: {exc}" if isinstance(exc, FxoptError) else \
        f"{culprit} failed: {type(exc).__name__}: {exc}"
    warn_fallback(name, reason)
    if opts.reports is not None:
        opts.reports.append(CompiledGraph(name, training, [], None, fallback=reason))
    return _plain_inductor(gm, example_inputs, opts, training)


def _plain_inductor(gm: fx.GraphModule, example_inputs: list[Any], opts: BackendOptions,
                    training: bool) -> Callable:
    """Inductor as torch.compile would run it: the user's Inductor options, no fxopt hooks."""
    from torch._inductor.compile_fx import compile_fx

    plain = BackendOptions(inductor=opts.inductor, mode=opts.mode)
    return compile_fx(gm, example_inputs, config_patches=plain.inductor_patches(frozen=False, training=training))


def _unfrozen(gm: fx.GraphModule, args: list[Any], opts: BackendOptions, record: CompiledGraph,
              training: bool) -> Callable:
    """``gm`` compiled by plain Inductor with its weights as inputs, after they changed."""
    record.fallback = "weights changed after the graph froze them: compiled again with weights as inputs"
    return _plain_inductor(gm, args, opts, training=training)

