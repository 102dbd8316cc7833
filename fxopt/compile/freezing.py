"""Freezing: the weights of an inference graph become constants of the graph.

Dynamo lifts parameters and buffers into graph *inputs* (``inline_inbuilt_nn_modules``), so
a pass would never see constant weights. For inference graphs (``torch.is_grad_enabled()``
is false, or no input requires grad) the backend does what Inductor's freezing does one
level down: every parameter/buffer placeholder that the graph never writes to becomes a
``get_attr`` of that same tensor (parameters stay Parameters, buffers are registered as
buffers), and the compiled function drops those arguments. Inductor's own ``freezing`` is
switched on for the same graphs, so the (possibly rewritten) weights end up as Inductor
constants. Like Inductor's freezing, the compiled graph keeps the weight values it was
compiled with; :class:`FrozenWeights` notices in-place writes to them. Training graphs are
never frozen.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxopt.analysis.alias import storages_of, traced_value, written_storages
from fxopt.analysis.shapes import VALUES_CURRENT
from fxopt.graph_utils import fresh_attr_name
from fxopt.pass_protocol import Pass, PassResult

__all__ = ["FreezeParameters", "FrozenWeights", "is_weight", "sync_dynamo_metadata", "traced_frozen", "work_copy"]


def work_copy(gm: fx.GraphModule) -> fx.GraphModule:
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
            if not is_weight(node, value) or storages_of(traced_value(node)) & written:
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


def traced_frozen(gm: fx.GraphModule, training: bool) -> bool:
    """Whether Dynamo already made the weights graph attributes, as it does while the
    global ``torch._inductor.config.freezing`` (or ``torch._dynamo.config.prepare_freezing``)
    is set: nothing is left to freeze, but the weights are constants all the same, so the
    layout passes apply. (Missing this left fused convs with NCHW weights whenever a caller
    set the global freezing flag.)"""
    if training or not any(isinstance(v, torch.nn.Parameter) for v in gm.parameters()):
        return False
    # an optimizer's update writes the very parameters: they are state, not constants
    written = written_storages(gm.graph)
    return written is not None and not any(
        storages_of(traced_value(n)) & written for n in gm.graph.find_nodes(op="get_attr") if traced_value(n) is not None)


def is_weight(node: fx.Node, value: Any) -> bool:
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


def sync_dynamo_metadata(gm: fx.GraphModule) -> None:
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

