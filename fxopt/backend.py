"""The torch.compile hand-off: the ``fxopt`` Dynamo backend and Inductor custom passes.

``torch.compile(model, backend="fxopt", options={...})`` (or :func:`compile`) runs fxopt
passes over every graph Dynamo captures, then hands the result to Inductor's
``compile_fx``. Two levels, as DESIGN.md describes:

* **torch level** (``passes``): the Dynamo graph itself, before AOTAutograd. This is where
  conv-BN folding and quantization see ``torch.conv2d`` / ``F.batch_norm`` calls.
* **ATen level** (``post_grad_pre_passes`` and friends): fxopt pipelines installed as
  Inductor custom passes (:class:`InductorPass`, a ``CustomGraphPass`` with a stable
  ``uuid()``), so the FX graph cache and the AOTAutograd cache keep working.

Freezing. Dynamo lifts parameters and buffers into graph *inputs*
(``inline_inbuilt_nn_modules``), so a pass would never see constant weights. For
inference graphs (``torch.is_grad_enabled()`` is false, or no input requires grad) the
backend does what Inductor's freezing does one level down: every parameter/buffer
placeholder that the graph never writes to becomes a ``get_attr`` of that same tensor
(parameters stay Parameters, buffers are registered as buffers), and the compiled function
drops those arguments. Inductor's own
``freezing`` is switched on for the same graphs, so the (possibly rewritten) weights end
up as Inductor constants. After the user's passes, the layout passes of
:mod:`fxopt.passes.layout` prepare the half-precision CUDA convolutions for cuDNN's tensor
cores (channels-last weights, as Inductor's freezing does for the convolutions it sees,
and RGB stems padded to 8 channels). On every inference graph (training graphs too with
``sdpa_in_training=True``), attention whose sizes are symbolic calls ``F.scaled_dot_product_attention`` at run time (:mod:`fxopt.passes.attention`:
Inductor would compile the fp32 math fallback). Like Inductor's freezing, the compiled graph keeps the weight
values it was compiled with: after changing weights, call ``torch._dynamo.reset()``.
Training graphs are never frozen and inference-only passes are skipped on them, with a
line in the report.

CUDA graphs. A compiled inference graph whose replay the caller could not tell from a
plain call (see :mod:`fxopt.replay`) is replayed as CUDA graphs, one per call shape (at
most ``replay_shapes``), from the second call of each shape on: on conv nets, plain
launches are bound by host time, which fusing kernels does not cut. ``cuda_graphs=False``
turns it off; ``CompiledGraph.no_replay`` says why a graph is not replayed at all, and
``CompiledGraph.replay`` what ran for each shape.

Failure policy. Unknown options raise :class:`~fxopt.errors.PassOptionError` naming them.
A pass that fails on a graph does not break the user's ``torch.compile``: that graph is
compiled by plain Inductor and a warning names the pass; ``strict=True`` raises instead.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxopt.analysis.alias import storages_of, traced_value, written_storages
from fxopt.analysis.shapes import VALUES_CURRENT
from fxopt.errors import FxoptError, PassError, PassOptionError
from fxopt.graph_utils import fresh_attr_name
from fxopt.manager import PassManager, VerifyEach
from fxopt.optimize import DEFAULT_PIPELINE
from fxopt.pass_protocol import FunctionPass, Pass, PassResult
from fxopt.passes.attention import DeferSdpaChoice
from fxopt.passes.layout import ChannelsLastWeights, PadConvChannels
from fxopt.pipeline import Composite, Conditional, PassLike, resolve
from fxopt.replay import GraphReplay, ReplayLog
from fxopt.replay import refusal as replay_refusal
from fxopt.report import Report
from fxopt.snapshot import GraphSnapshot
from fxopt.training import PlainOutputs, fresh_outputs, inductor_skips, training_route
from fxopt.training import refusal as training_refusal

try:  # torch >= 2.6; the import path has been stable since
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - older torch has no cache-safe custom passes
    CustomGraphPass = object  # type: ignore[assignment,misc]

__all__ = ["BackendOptions", "CompiledGraph", "InductorPass", "compile", "fxopt_backend"]

#: Inductor config entries the ATen-level pipelines are installed into, by option name
INDUCTOR_HOOKS: dict[str, str] = {
    "post_grad_pre_passes": "post_grad_custom_pre_pass",
    "post_grad_post_passes": "post_grad_custom_post_pass",
    "joint_pre_passes": "joint_custom_pre_pass",
    "joint_post_passes": "joint_custom_post_pass",
}

_BACKEND = "fxopt backend"


@dataclass(frozen=True)
class BackendOptions:
    """The options of the ``fxopt`` backend (``options={...}`` of ``torch.compile``)."""

    #: torch-level pipeline run on each Dynamo graph (default: fxopt.DEFAULT_PIPELINE)
    passes: Any = None
    #: ATen-level pipelines run inside Inductor (see INDUCTOR_HOOKS)
    post_grad_pre_passes: Any = None
    post_grad_post_passes: Any = None
    joint_pre_passes: Any = None
    joint_post_passes: Any = None
    #: turn parameters/buffers into constants on inference graphs (and use Inductor freezing)
    freeze: bool = True
    #: raise instead of falling back to plain Inductor when a pass fails
    strict: bool = False
    #: check every changing torch-level pass numerically on the graph's example inputs
    verify: bool = False
    #: a list that receives one CompiledGraph per graph the backend compiles
    reports: list | None = None
    #: Inductor config patches, as torch.compile's ``options`` would give them to Inductor
    inductor: Mapping[str, Any] = field(default_factory=dict)
    #: a torch.compile mode ("max-autotune", ...), translated to Inductor options
    mode: str | None = None
    #: replay inference graphs as CUDA graphs where the caller cannot tell (fxopt.replay)
    cuda_graphs: bool = True
    #: the most call shapes of one graph kept captured as CUDA graphs (least recently used
    #: evicted); each holds its input buffers and outputs in the graph's memory pool
    replay_shapes: int = 8
    #: replay training steps (forward, backward, optimizer update) through Inductor's CUDA-graph
    #: trees with plain-call semantics (fxopt.training): None (the default) wherever that is
    #: sound, False never (``cuda_graphs=False`` turns it off too), True the same as None but a
    #: graph that cannot be replayed warns, naming the option and why
    training_cuda_graphs: bool | None = None
    #: also rewrite symbolic-size attention in training graphs (``fxopt.sdpa``'s backward runs
    #: the fused kernels' forward again and differentiates it); checked against eager on CPU
    #: only, not yet run under a GPU's CUDA-graph recording, so it waits for that to be default
    sdpa_in_training: bool = False
    #: training graphs: recompute saved activations until each graph's predicted activation
    #: peak is at most this fraction of the stock partition's (fxopt.memory.budget)
    memory_budget: float | None = None

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None = None, mode: str | None = None) -> BackendOptions:
        """Validate ``options`` (unknown keys, types, pipelines) before anything compiles."""
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise PassOptionError(_BACKEND, ", ".join(unknown),
                                  f"unknown option(s) {unknown}; known options: {', '.join(known)}")
        if mode is not None:
            options.setdefault("mode", mode)
        for key in ("freeze", "strict", "verify", "cuda_graphs", "training_cuda_graphs"):
            if key in options and not isinstance(options[key], bool) and not (
                    key == "training_cuda_graphs" and options[key] is None):
                raise PassOptionError(_BACKEND, key, f"expected bool, got {options[key]!r}")
        shapes = options.get("replay_shapes", 1)
        if not isinstance(shapes, int) or isinstance(shapes, bool) or shapes < 1:
            raise PassOptionError(_BACKEND, "replay_shapes", f"expected an int >= 1, got {shapes!r}")
        if options.get("reports") is not None and not isinstance(options["reports"], list):
            raise PassOptionError(_BACKEND, "reports", "expected a list to append reports to")
        budget = options.get("memory_budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float)
                                   or not 0 < budget <= 1):
            raise PassOptionError(_BACKEND, "memory_budget", f"expected a fraction in (0, 1], got {budget!r}")
        if budget is not None and not hasattr(torch._inductor.config, "custom_partitioner_fn"):
            raise PassOptionError(_BACKEND, "memory_budget", f"this torch ({torch.__version__}) has no "
                                  "Inductor hook 'custom_partitioner_fn'")
        inductor = options.get("inductor") or {}
        if not isinstance(inductor, Mapping):
            raise PassOptionError(_BACKEND, "inductor", f"expected a dict of Inductor options, got {inductor!r}")
        if budget is not None and "custom_partitioner_fn" in inductor:
            raise PassOptionError(_BACKEND, "memory_budget", "the budget is applied through Inductor's "
                                  "custom_partitioner_fn, which inductor={...} sets too: give one of them")
        bad = sorted(k for k in inductor if not _is_inductor_option(k))
        if bad:
            raise PassOptionError(_BACKEND, "inductor", f"unknown Inductor option(s) {bad}")
        if options.get("mode") not in (None, "default"):
            try:
                torch._inductor.list_mode_options(options["mode"])
            except RuntimeError as exc:
                raise PassOptionError(_BACKEND, "mode", str(exc)) from None
        parsed = cls(**options)
        for key in ("passes", *INDUCTOR_HOOKS):
            pipeline = parsed.pipeline(key)
            if pipeline is not None:
                PassManager(pipeline)  # names, options and ordering are checked here
        missing = [k for k in INDUCTOR_HOOKS if options.get(k) and not hasattr(torch._inductor.config, INDUCTOR_HOOKS[k])]
        if missing:
            raise PassOptionError(_BACKEND, missing[0], f"this torch ({torch.__version__}) has no "
                                  f"Inductor hook {INDUCTOR_HOOKS[missing[0]]!r}")
        return parsed

    def pipeline(self, key: str) -> PassLike | None:
        value = getattr(self, key)
        if key == "passes" and value is None:
            return list(DEFAULT_PIPELINE)
        return value or None

    def inductor_patches(self, *, frozen: bool, training: bool,
                         sink: list[tuple[str, Report]] | None = None,
                         budget_sink: list | None = None) -> dict[str, Any]:
        patches: dict[str, Any] = {}
        if self.mode not in (None, "default"):
            patches.update(torch._inductor.list_mode_options(self.mode))
        if frozen:
            patches["freezing"] = True
        if training and self.memory_budget is not None:
            from fxopt.memory.budget import BudgetPartitioner

            patches["custom_partitioner_fn"] = BudgetPartitioner(self.memory_budget, reports=budget_sink)
        for key, config_name in INDUCTOR_HOOKS.items():
            pipeline = self.pipeline(key)
            if pipeline is not None:
                patches[config_name] = InductorPass(pipeline, hook=config_name, training=training,
                                                    strict=self.strict, reports=sink)
        patches.update(self.inductor)
        return patches


def _is_inductor_option(name: str) -> bool:
    import torch._inductor.config as config

    entries = getattr(config, "_config", None)  # ConfigModule's table of every entry
    return name in entries if entries is not None else hasattr(config, name.split(".")[0])


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


# --- the backend ---------------------------------------------------------------------

def fxopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                  options: Mapping[str, Any] | None = None, mode: str | None = None) -> Callable:
    """The Dynamo backend registered as ``"fxopt"``: fxopt passes, then Inductor."""
    return _compile_graph(gm, list(example_inputs), BackendOptions.parse(options, mode))


def compile(model: Callable, passes: PassLike | Iterable[PassLike] | None = None, *,
            options: Mapping[str, Any] | None = None, **torch_compile_kwargs: Any) -> Callable:
    """``torch.compile(model, backend="fxopt")`` with ``passes`` as the torch-level pipeline.

    ``options`` takes the other backend options (see :class:`BackendOptions`);
    ``torch_compile_kwargs`` go to ``torch.compile`` (``dynamic``, ``fullgraph``, ``mode``).
    Options are validated here, so mistakes raise at once rather than at the first call.
    """
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


def is_training(example_inputs: Sequence[Any]) -> bool:
    """A graph is trained when autograd is on and some input requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def _compile_graph(gm: fx.GraphModule, example_inputs: list[Any], opts: BackendOptions) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    training = is_training(example_inputs)
    name = str(gm.meta.get("dynamo_compile_id", type(gm).__name__))
    try:
        work = _work_copy(gm)
        # a run of its own: verification needs the inputs the frozen graph still takes
        freezing = PassManager([FreezeParameters(example_inputs)] if opts.freeze else []).run(
            work, training=training).records
        frozen = [name for r in freezing for name in r.stats.get("frozen", [])]
        keep = next((r.stats["inputs_kept"] for r in freezing if r.changed), list(range(len(example_inputs))))
        hooks = [VerifyEach(work, [example_inputs[i] for i in keep])] if opts.verify else []
        passes = resolve(opts.pipeline("passes") or [])
        constant = bool(frozen) or _traced_frozen(work, training, opts)
        if constant:  # constant weights: lay convolutions out for cuDNN's tensor cores
            passes += [PadConvChannels(), ChannelsLastWeights()]
        if not training or opts.sdpa_in_training:  # Inductor cannot choose a fused kernel for symbolic sizes
            passes.append(DeferSdpaChoice())
        report = PassManager(passes, hooks=hooks).run(work, training=training)
        report.records[:0] = freezing
        if opts.memory_budget is not None and not training:
            report.warnings.append("memory_budget does not apply: an inference graph (autograd off or no input "
                                   "requiring grad) saves nothing for a backward")
        _sync_dynamo_metadata(work)
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
        _warn(name, reason)
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
    """Whether ``work`` is replayed as part of a training step (fxopt.training): then
    Inductor's CUDA-graph trees are switched on in ``patches``. A training-step graph that
    is refused gets the reason in ``record.no_replay``."""
    placeholders = list(work.graph.find_nodes(op="placeholder"))
    state = {node for node, value in zip(placeholders, inputs) if _is_weight(node, value)}
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
    _warn(name, reason)
    if opts.reports is not None:
        opts.reports.append(CompiledGraph(name, training, [], None, fallback=reason))
    return _plain_inductor(gm, example_inputs, opts, training)


def _plain_inductor(gm: fx.GraphModule, example_inputs: list[Any], opts: BackendOptions,
                    training: bool) -> Callable:
    """Inductor as torch.compile would run it: the user's Inductor options, no fxopt hooks."""
    from torch._inductor.compile_fx import compile_fx

    plain = BackendOptions(inductor=opts.inductor, mode=opts.mode)
    return compile_fx(gm, example_inputs, config_patches=plain.inductor_patches(frozen=False, training=training))


def _warn(graph_name: str, reason: str) -> None:
    warnings.warn(f"fxopt backend: {reason}; graph {graph_name} is compiled by plain Inductor "
                  "(pass strict=True to raise instead)", RuntimeWarning, stacklevel=2)


class FrozenWeights:
    """A graph compiled with its weights as constants, called as Dynamo calls it (weights
    included), that notices when the weights change.

    Frozen constants are what the weights were at compile time (folded, laid out anew), so
    a graph that kept running them after an optimizer step, ``load_state_dict`` or any
    other in-place write would compute with stale weights: an evaluation under
    ``no_grad`` between training steps would be wrong. Each call compares the weights'
    version counters (every in-place write bumps them) with those seen at compile time;
    once one differs, the graph is compiled again with its weights as inputs (by
    ``unfrozen``, once) and runs that way from then on. A weight rebound with
    ``param.data = ...`` keeps its counter and is not noticed: call ``torch._dynamo.reset()``.
    """

    def __init__(self, compiled: Callable, keep: Sequence[int], weights: Sequence[torch.Tensor],
                 unfrozen: Callable[[list[Any]], Callable]):
        self.compiled, self.keep, self.weights = compiled, list(keep), list(weights)
        self.versions = list(map(_VERSION, self.weights))
        self.unfrozen = unfrozen
        self.plain: Callable | None = None

    def __call__(self, *args: Any) -> Any:
        if self.plain is None:
            if list(map(_VERSION, self.weights)) == self.versions:
                return self.compiled(*[args[i] for i in self.keep])
            self.plain = self.unfrozen(list(args))
        return self.plain(*args)


_VERSION = operator.attrgetter("_version")


def _unfrozen(gm: fx.GraphModule, args: list[Any], opts: BackendOptions, record: CompiledGraph,
              training: bool) -> Callable:
    """``gm`` compiled by plain Inductor with its weights as inputs, after they changed."""
    record.fallback = "weights changed after the graph froze them: compiled again with weights as inputs"
    return _plain_inductor(gm, args, opts, training=training)


# --- freezing ------------------------------------------------------------------------

def _work_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph over the same module (so the same tensors), with Dynamo's
    example values as ``meta['val']``; ``gm`` itself stays untouched for a fallback.

    The module is a shallow copy of Dynamo's, with tables of its own (so a pass that
    registers a tensor leaves ``gm`` as it was): AOTAutograd reads more of a Dynamo graph
    module than its graph. A new ``GraphModule`` around the copied graph, given only
    ``_param_name_to_source``, made AOTAutograd count saved weights as buffers it may donate
    to the backward, and ``retain_graph=True`` failed where plain ``torch.compile`` runs."""
    graph = copy.deepcopy(gm.graph)
    work = type(gm).__new__(type(gm))
    work.__dict__.update(gm.__dict__)
    for table in ("_parameters", "_buffers", "_modules", "meta"):
        setattr(work, table, dict(getattr(gm, table)))
    work.graph = graph
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    for node in graph.nodes:
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
    work.meta[VALUES_CURRENT] = True  # Dynamo's own example values: no need to propagate again
    return work


class FreezeParameters(Pass):
    """Turn the parameter/buffer inputs the graph never writes into constants.

    The constants are the user's tensors themselves (``get_attr`` of the very tensor;
    parameters stay Parameters). ``stats['inputs_kept']`` lists the indices of the inputs
    the graph still takes, ``stats['frozen']`` the placeholders that became constants.
    """

    name = "freeze_parameters"
    inference_only = True  # a trained graph needs its parameters as inputs

    def __init__(self, example_inputs: Sequence[Any]):
        super().__init__()
        self.example_inputs = list(example_inputs)

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        graph = gm.graph
        placeholders = list(graph.find_nodes(op="placeholder"))
        keep = list(range(len(self.example_inputs)))
        written = written_storages(graph)
        if written is None:
            return PassResult(False, {"frozen": [], "inputs_kept": keep,
                                      "not frozen": "a written tensor has no fake value"})
        frozen: list[str] = []
        anchor = placeholders[-1] if placeholders else None
        for index, (node, value) in enumerate(zip(placeholders, self.example_inputs)):
            if not _is_weight(node, value) or storages_of(traced_value(node)) & written:
                continue
            attr = fresh_attr_name(gm, f"_frozen_{node.name}")
            if isinstance(value, torch.nn.Parameter):
                # kept a Parameter, requires_grad and all: decompositions read the flag. aten's
                # matmul folds a linear on a transposed 3-d input into one mm only for a weight
                # that requires grad; detached, ViT's attention projections became expand+bmm
                # where Inductor's own freezing has one mm (tests/compile: same post-grad ops)
                gm.register_parameter(attr, value)
            else:
                gm.register_buffer(attr, value.detach())
            with graph.inserting_after(anchor):
                getter = graph.get_attr(attr)
            getter.meta.update({k: v for k, v in node.meta.items() if k in ("val", "example_value")})
            node.replace_all_uses_with(getter)
            graph.erase_node(node)
            keep.remove(index)
            frozen.append(node.name)
        return PassResult(bool(frozen), {"frozen": frozen, "inputs_kept": keep})


def _traced_frozen(gm: fx.GraphModule, training: bool, opts: BackendOptions) -> bool:
    """Whether Dynamo already made the weights graph attributes, as it does while the
    global ``torch._inductor.config.freezing`` (or ``torch._dynamo.config.prepare_freezing``)
    is set: nothing is left to freeze, but the weights are constants all the same, so the
    layout passes apply. (Missing this left fused convs with NCHW weights whenever a caller
    set the global freezing flag.)"""
    if not opts.freeze or training or not any(isinstance(v, torch.nn.Parameter) for v in gm.parameters()):
        return False
    # an optimizer's update writes the very parameters: they are state, not constants
    written = written_storages(gm.graph)
    return written is not None and not any(
        storages_of(traced_value(n)) & written for n in gm.graph.find_nodes(op="get_attr") if traced_value(n) is not None)


def _is_weight(node: fx.Node, value: Any) -> bool:
    """A parameter or buffer of a module (never a user input marked static for cudagraphs).

    Tensor subclasses (DTensor shards of a tensor-parallel model) stay inputs: Inductor's
    freezing cannot take them as constants, and AOTAutograd unwraps them only as inputs.
    """
    if not isinstance(value, torch.Tensor) or is_traceable_wrapper_subclass(value):
        return False
    if isinstance(value, torch.nn.Parameter):
        return True
    source = getattr(node, "_dynamo_source", None)
    try:
        from torch._dynamo.source import is_from_unspecialized_param_buffer_source
    except ImportError:  # pragma: no cover
        return False
    return source is not None and is_from_unspecialized_param_buffer_source(source)


def _sync_dynamo_metadata(gm: fx.GraphModule) -> None:
    """Keep AOTAutograd's view of Dynamo metadata consistent with the rewritten graph.

    ``_param_name_to_source`` must name every parameter/buffer AOTAutograd lifts; the
    frozen constants and the tensors passes create have no Dynamo source, so without it
    AOTAutograd treats registered tensors as static inputs (as it does for export).
    """
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is None:
        return
    names = [n for n, _ in gm.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in gm.named_buffers(remove_duplicate=False)]
    if any(n not in sources for n in names):
        del gm._param_name_to_source


# --- ATen-level passes inside Inductor -----------------------------------------------

class InductorPass(CustomGraphPass):
    """An fxopt pipeline as an Inductor custom graph pass, with a stable ``uuid()``.

    The uuid hashes what decides the pass's behaviour: the pipeline (names, options,
    nesting), the source files of every pass and predicate in it, fxopt's own core
    sources, the training flag and strictness. Equal pipelines give equal uuids across
    processes, so Inductor's FX graph cache and the AOTAutograd cache hit; a pipeline whose
    code cannot be found (a lambda typed at a prompt) gets ``None``, which makes Inductor
    skip its caches rather than reuse a stale entry.
    """

    def __init__(self, passes: PassLike | Iterable[PassLike], *, hook: str = "post_grad_custom_pre_pass",
                 training: bool = False, strict: bool = False,
                 reports: list[tuple[str, Report]] | None = None):
        self.manager = PassManager(passes)
        self.hook, self.training, self.strict = hook, training, strict
        self.reports = reports
        self._uuid = _pipeline_uuid(self.manager.passes, (hook, training, strict))

    def uuid(self) -> str | None:
        return self._uuid

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        snapshot = GraphSnapshot.take(graph)
        try:
            report = self.manager.run(gm, training=self.training)
        except FxoptError as exc:
            if self.strict:
                raise
            _restore_in_place(graph, snapshot)
            gm.graph = graph
            gm.recompile()
            culprit = f"pass {exc.pass_name!r}" if isinstance(exc, PassError) else "fxopt"
            _warn(f"({self.hook})", f"{culprit} failed inside Inductor's {self.hook}: {exc}")
            return
        if self.reports is not None:
            self.reports.append((self.hook, report))


def _restore_in_place(graph: fx.Graph, snapshot: GraphSnapshot) -> None:
    """Put ``graph`` (the very object Inductor holds on to) back to ``snapshot``."""
    rebuilt = snapshot.build()
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    if [n.name for n in rebuilt.find_nodes(op="placeholder")] != list(placeholders):
        raise RuntimeError("an ATen-level pass changed the graph's inputs; it cannot be restored in place")
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    env: dict[fx.Node, fx.Node] = {}
    for node in rebuilt.nodes:
        env[node] = placeholders[node.name] if node.op == "placeholder" else graph.node_copy(node, env.__getitem__)


def _pipeline_uuid(passes: Sequence[Pass], extra: Any) -> str | None:
    hasher = hashlib.sha256(repr((list(map(repr, passes)), extra)).encode())
    hasher.update(_core_source_hash())
    files: set[str] = set()
    for obj in _code_objects(passes):
        try:
            source = inspect.getsourcefile(obj)
        except TypeError:
            source = None
        if source is None or not Path(source).is_file():
            return None
        files.add(source)
        hasher.update(getattr(obj, "__qualname__", repr(obj)).encode())
    for path in sorted(files):
        hasher.update(Path(path).read_bytes())
    return hasher.hexdigest()


def _code_objects(passes: Iterable[Pass]) -> Iterable[Any]:
    for p in passes:
        if isinstance(p, FunctionPass):
            yield p.fn
        else:
            yield type(p)
        if isinstance(p, Conditional):
            yield p.predicate
        if isinstance(p, Composite):
            yield from _code_objects(p.children)


_CORE_HASH: bytes | None = None


def _core_source_hash() -> bytes:
    """A hash of fxopt's own sources: the manager and analyses shape what passes do."""
    global _CORE_HASH
    if _CORE_HASH is None:
        hasher = hashlib.sha256()
        root = Path(__file__).parent
        for path in sorted([*root.glob("*.py"), *root.glob("analysis/*.py")]):
            hasher.update(path.read_bytes())
        _CORE_HASH = hasher.digest()
    return _CORE_HASH
