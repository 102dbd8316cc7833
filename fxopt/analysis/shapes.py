"""Shapes and dtypes by FakeTensor propagation, stored where torch's own tools look.

Every node gets ``meta['val']`` (a FakeTensor, or a nested structure of them) and
``meta['tensor_meta']``. FakeTensors carry storages, so aliasing (views share their
base's storage) falls out of the same run; see :mod:`fxopt.analysis.alias`.

Inputs come from the run's example inputs or, for graphs that already carry them
(torch.export, make_fx, Dynamo), from the placeholders' ``meta['val']``; the existing
fake mode (and its ShapeEnv, for dynamic shapes) is reused so symbols stay symbolic.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, UnsupportedOperatorException
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from fxopt.analysis.fake_lock import fake_mode_lock
from fxopt.analysis.registry import register_analysis
from fxopt.errors import AnalysisError, MissingFakeImplError


@dataclass
class FakeState:
    """The fake mode every shape propagation of one run uses, and the fake tensors it made
    of the example inputs and the module's parameters and buffers.

    torch memoizes real-to-fake conversions, but holds the fakes weakly: a parameter seen
    only inside a ``call_module`` would be converted again by every propagation (most of
    a re-propagation's cost on a large model). Holding them here keeps the memo's answers
    alive; the memo stays right because passes may not change existing tensors (the
    manager's TensorGuard) and new tensors are new keys. A graph that changes a fake's
    metadata in place (``x.unsqueeze_(0)`` on an input) makes it stale for the next run:
    :meth:`intact` says so, and the next propagation starts a new state.
    """

    mode: FakeTensorMode
    #: id -> (the fake, its layout when made)
    fakes: dict[int, tuple[FakeTensor, tuple]] = field(default_factory=dict)

    def keep(self, fake: FakeTensor) -> None:
        if id(fake) not in self.fakes:
            self.fakes[id(fake)] = (fake, _layout(fake))

    def intact(self) -> bool:
        """Whether every kept fake still has the layout it was made with."""
        return all(_layout(fake) == layout for fake, layout in self.fakes.values())


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, StorageWeakRef(t.untyped_storage())


class _FakePropagator(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, state: FakeState):
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False
        self.mode = state.mode
        self.state = state

    def _to_fake(self, value: Any) -> Any:
        def convert(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
                fake = self.mode.from_tensor(x, static_shapes=True)
                self.state.keep(fake)
                return fake
            return x

        return tree_map(convert, value)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        return call_module_on_copies(self.fetch_attr(target), args, kwargs, self._to_fake)

    def run_node(self, node: fx.Node) -> Any:
        try:
            result = super().run_node(node)
        except Exception as exc:  # every failure is reported at the node that failed
            if _no_fake_impl(exc):
                raise MissingFakeImplError(_op_name(node), node.name, str(exc)) from exc
            raise AnalysisError("shapes", f"{type(exc).__name__}: {exc}", node=node.name) from exc
        if node.op == "get_attr":
            result = self._to_fake(result)
        record_value(node, result)
        return result


def call_module_on_copies(module: torch.nn.Module, args: Any, kwargs: Any,
                          parameter: Callable[[Any], Any],
                          buffer: Callable[[Any], Any] | None = None) -> Any:
    """Call ``module`` on copies of its parameters and buffers, made by ``parameter`` and
    ``buffer`` (default: ``parameter``).

    Analyses run the graph to learn about it; a training-mode batch norm run on its real
    state would write it (``num_batches_tracked.add_(1)``, running statistics), and the
    user's model would change because fxopt looked at it.
    """
    buffer = buffer or parameter
    cls = type(module)
    if (cls.__setattr__ is nn.Module.__setattr__ and cls.__getattr__ is nn.Module.__getattr__
            and not module._modules):
        # a plain leaf module (conv, batch norm, linear...): a shallow twin holding the
        # copies calls the same forward at a fraction of functional_call's cost. Modules
        # that keep their tensors elsewhere too (RNNs' flat weights, kept up to date by their
        # own __setattr__) and modules with children go through functional_call.
        twin = copy.copy(module)
        twin._parameters = {k: None if t is None else parameter(t) for k, t in module._parameters.items()}
        twin._buffers = {k: None if t is None else buffer(t) for k, t in module._buffers.items()}
        return twin(*args, **kwargs)
    state = {name: parameter(t) for name, t in module.named_parameters(remove_duplicate=False)}
    state |= {name: buffer(t) for name, t in module.named_buffers(remove_duplicate=False)}
    return torch.func.functional_call(module, state, tuple(args), dict(kwargs), strict=False)


def _no_fake_impl(exc: BaseException) -> bool:
    """Whether ``exc`` says an op has no fake implementation (not that the inputs are bad)."""
    return isinstance(exc, UnsupportedOperatorException) or "no fake impl" in str(exc).lower()


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
    return getattr(target, "__qualname__", str(target))


def record_value(node: fx.Node, value: Any) -> None:
    """Store ``value`` (fake) as ``meta['val']`` and its metadata as ``meta['tensor_meta']``."""
    node.meta["val"] = value
    if isinstance(value, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(value)
    elif isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        node.meta["tensor_meta"] = type(value)(_extract_tensor_metadata(v) for v in value)
    else:
        node.meta.pop("tensor_meta", None)


def fake_mode_for(gm: fx.GraphModule, example_inputs: Any,
                  mode: FakeTensorMode | None = None) -> tuple[FakeTensorMode, list[Any]]:
    """The fake mode and fake placeholder values to propagate ``gm`` with: the mode of the
    placeholders' values without example inputs, else ``mode`` or a new one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is None:
        vals = [p.meta.get("val") for p in placeholders]
        for p, v in zip(placeholders, vals):
            if v is None:
                raise AnalysisError(
                    "shapes",
                    "no example inputs and the placeholder has no meta['val']; "
                    "pass example_inputs=(...) to fxopt.optimize / PassManager.run",
                    node=p.name,
                )
        mode = torch._guards.detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode_lock(mode):  # the placeholders' mode: other threads' graphs may share it
            mode.allow_non_fake_inputs = True
            fake = [mode.from_tensor(v) if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor)
                    else v for v in vals]
        return mode, fake
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    flat = gm.graph.process_inputs(*example_inputs)
    return mode, [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                  for x in flat]


#: ``gm.meta`` key: every node's ``meta['val']`` is current (a fresh Dynamo capture, whose
#: example values Dynamo computed itself). The next shape analysis adopts those values
#: instead of running the graph again, once: that run is most of fxopt's time inside the
#: ``torch.compile`` backend. Any pass that changes the graph invalidates the analysis,
#: and the run after it propagates as usual.
VALUES_CURRENT = "fxopt.values_current"


@register_analysis("shapes")
def propagate_shapes(gm: fx.GraphModule, ctx: Any) -> FakeTensorMode:
    """Run ``gm`` on fake inputs, filling ``meta['val']`` / ``meta['tensor_meta']``.

    Returns the fake mode used, so later analyses can create compatible fake tensors.
    """
    if gm.meta.pop(VALUES_CURRENT, False):
        adopted = _adopt_recorded_values(gm)
        if adopted is not None:
            return adopted
    example_inputs = getattr(ctx, "example_inputs", None)
    state = getattr(ctx, "fake_state", None)
    mode, fake_inputs = fake_mode_for(gm, example_inputs, state.mode if state is not None else None)
    if state is None or state.mode is not mode:
        state = FakeState(mode)
    if example_inputs is not None:  # memoized too: the next propagation gets the same fakes
        for fake in fake_inputs:
            if isinstance(fake, FakeTensor):
                state.keep(fake)
    propagator = _FakePropagator(gm, state)
    try:
        with fake_mode_lock(mode), mode, torch.no_grad():
            propagator.run(*fake_inputs, enable_io_processing=False)
    finally:  # a run that failed half-way may have changed a kept fake (x.unsqueeze_) all the same
        if hasattr(ctx, "fake_state"):
            ctx.fake_state = state if state.intact() else None
    return mode


def _adopt_recorded_values(gm: fx.GraphModule) -> FakeTensorMode | None:
    """The fake mode of the values already on every node (None if some node has none)."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    if any("val" not in n.meta for n in nodes):
        return None
    try:
        mode = torch._guards.detect_fake_mode([n.meta["val"] for n in nodes])
    except AssertionError:  # values from several fake modes: not one capture's
        return None
    if mode is None:
        return None
    for node in nodes:
        if "tensor_meta" not in node.meta:
            record_value(node, node.meta["val"])
    return mode
