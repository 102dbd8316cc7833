"""Shapes and dtypes by FakeTensor propagation, stored where torch's own tools look.

Every node gets ``meta['val']`` (a FakeTensor, or a nested structure of them) and
``meta['tensor_meta']``. FakeTensors carry storages, so aliasing (views share their
base's storage) falls out of the same run; see :mod:`fxopt.analysis.alias`.

Inputs come from the run's example inputs or, for graphs that already carry them
(torch.export, make_fx, Dynamo), from the placeholders' ``meta['val']``; the existing
fake mode (and its ShapeEnv, for dynamic shapes) is reused so symbols stay symbolic.

**Meta values.** A run whose passes need only shapes, dtypes, strides and storage sharing
(``Pass.needs_fake_values`` false for all of them: the default pipeline) propagates with
fxopt's own rules instead (:mod:`fxopt.analysis.shape_rules`) when every node of the graph
has one and its tensors are plain tensors on one device: then ``meta['val']`` holds
``meta``-device tensors with the same shapes, strides, dtypes and storage sharing a
FakeTensor run gives, and ``gm.meta[META_VALUES_DEVICE]`` the device they stand for. That
path never constructs a ``FakeTensorMode``, which imports ``torch._dynamo`` (about a second
of CPU on the first call of a process). Anything else takes the FakeTensor path, for the
whole graph: no graph mixes the two kinds of value.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, UnsupportedOperatorException
from torch.fx.passes.shape_prop import TensorMetadata, _extract_tensor_metadata
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from fxopt.analysis.fake_lock import fake_mode_lock
from fxopt.analysis.registry import register_analysis
from fxopt.analysis.shape_rules import Env, NoRule, evaluate, has_rule, meta_copy
from fxopt.errors import AnalysisError, MissingFakeImplError


def symbolic_dispatch(values: Any) -> contextlib.AbstractContextManager:
    """The Python dispatcher where ``values`` hold a tensor with a symbolic size, else
    nothing. Fake tensors run an op's C++ kernel unless the Python dispatcher is on, and a
    kernel that reads sizes as ints (``F.pad``'s) turns each symbolic size into a guard on
    its traced value: Dynamo then compiled the graph again for every batch size. Dynamo and
    AOTAutograd trace with it on; it is thread-local."""
    if any(isinstance(t, torch.Tensor) and not all(isinstance(n, int) for n in t.shape)
           for t in pytree.tree_leaves(values)):
        return enable_python_dispatcher()
    return contextlib.nullcontext()


def fake_call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn`` on recorded values (a pass computing the value of a node it adds), under the
    first fake value's own mode, if any, and :func:`symbolic_dispatch`: called on fake
    values from outside, an op whose kernel reads sizes as ints pins a symbolic batch."""
    mode = next((t.fake_mode for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)), None)
    with mode or contextlib.nullcontext(), symbolic_dispatch((args, kwargs)):
        return fn(*args, **kwargs)


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
    """Store ``value`` (fake or meta) as ``meta['val']`` and its metadata as
    ``meta['tensor_meta']``."""
    node.meta["val"] = value
    if isinstance(value, torch.Tensor):
        node.meta["tensor_meta"] = _metadata(value)
    elif isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        node.meta["tensor_meta"] = type(value)(_metadata(v) for v in value)
    else:
        node.meta.pop("tensor_meta", None)


_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def _metadata(t: torch.Tensor) -> TensorMetadata:
    """torch's ``TensorMetadata`` of ``t``. For a plain meta tensor (static sizes) it is
    built here with C++ contiguity checks: torch's ``_extract_tensor_metadata`` asks
    ``torch.fx.experimental.symbolic_shapes``, whose import (sympy) costs 0.3 s."""
    if type(t) is not torch.Tensor or not t.is_meta:
        return _extract_tensor_metadata(t)
    memory_format = next((f for f in _MEMORY_FORMATS if t.is_contiguous(memory_format=f)), None)
    return TensorMetadata(t.shape, t.dtype, t.requires_grad, t.stride(), memory_format, False, {})


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
        device = gm.meta.get(META_VALUES_DEVICE)
        with fake_mode_lock(mode):  # the placeholders' mode: other threads' graphs may share it
            mode.allow_non_fake_inputs = True
            fake = [_from_meta_value(mode, v, device) if device is not None and _is_meta_value(v)
                    else mode.from_tensor(v) if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor)
                    else v for v in vals]
        return mode, fake
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    flat = gm.graph.process_inputs(*example_inputs)
    return mode, [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                  for x in flat]


def _is_meta_value(value: Any) -> bool:
    return type(value) is torch.Tensor and value.is_meta


def _from_meta_value(mode: FakeTensorMode, value: torch.Tensor, device: torch.device) -> FakeTensor:
    """The fake tensor a meta value stands for: on the graph's real device."""
    with mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device,
                                   requires_grad=value.requires_grad)


#: ``gm.meta`` key: the device the graph's meta values stand for, while ``meta['val']``
#: holds meta values (fxopt's shape rules) rather than FakeTensors
META_VALUES_DEVICE = "fxopt.meta_values_device"

def value_device(node: fx.Node) -> torch.device:
    """The device ``node``'s recorded tensor value stands for: the value's own, or, where
    the graph carries meta values (fxopt's shape rules), the graph's real device. Rules
    that fire only on one device ask this rather than ``meta['val'].device``."""
    value = node.meta["val"]
    owner = node.graph.owning_module
    if _is_meta_value(value) and owner is not None and owner.meta.get(META_VALUES_DEVICE) is not None:
        return owner.meta[META_VALUES_DEVICE]
    return value.device


#: ``gm.meta`` key: every node's ``meta['val']`` is current (a fresh Dynamo capture, whose
#: example values Dynamo computed itself). The next shape analysis adopts those values
#: instead of running the graph again, once: that run is most of fxopt's time inside the
#: ``torch.compile`` backend. Any pass that changes the graph invalidates the analysis,
#: and the run after it propagates as usual.
VALUES_CURRENT = "fxopt.values_current"


@register_analysis("shapes")
def propagate_shapes(gm: fx.GraphModule, ctx: Any) -> FakeTensorMode | None:
    """Run ``gm`` on fake inputs, filling ``meta['val']`` / ``meta['tensor_meta']``.

    Returns the fake mode used, so later analyses can create compatible fake tensors;
    None where the run accepts meta values and the graph got them (see the module's
    docstring).
    """
    if gm.meta.pop(VALUES_CURRENT, False):
        adopted = _adopt_recorded_values(gm)
        if adopted is not None:
            gm.meta.pop(META_VALUES_DEVICE, None)
            return adopted
    example_inputs = getattr(ctx, "example_inputs", None)
    if getattr(ctx, "meta_values", False):
        done = propagate_meta_values(gm, example_inputs, getattr(ctx, "meta_record", None))
        if hasattr(ctx, "meta_record"):
            ctx.meta_record = done
        if done is not None:
            return None
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
        with fake_mode_lock(mode), mode, torch.no_grad(), symbolic_dispatch(fake_inputs):
            propagator.run(*fake_inputs, enable_io_processing=False)
    finally:  # a run that failed half-way may have changed a kept fake (x.unsqueeze_) all the same
        if hasattr(ctx, "fake_state"):
            ctx.fake_state = state if state.intact() else None
    gm.meta.pop(META_VALUES_DEVICE, None)
    return mode


def propagate_meta_values(gm: fx.GraphModule, example_inputs: Any, previous: MetaRecord | None = None,
                          *, record: bool = True) -> MetaRecord | None:
    """Give every node its meta value by fxopt's shape rules; None, with the graph untouched,
    where some node has no rule or a tensor is not a plain tensor on the one device. Inputs
    are the example inputs, else the meta values the placeholders carry.

    With the ``previous`` propagation's record of this graph, only the nodes a pass touched
    and those downstream of them are evaluated again (:class:`MetaRecord`). ``record=False``
    only checks that the graph runs on these inputs: no node's metadata is written."""
    nodes = list(gm.graph.nodes)
    if not all(has_rule(gm, n) for n in nodes):
        return None
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if any(str(p.target).startswith("*") for p in placeholders):
        return None
    device = gm.meta.get(META_VALUES_DEVICE)
    if example_inputs is None:
        inputs = [p.meta.get("val") for p in placeholders]
        identity = _ids(inputs)
        if device is None:
            device, inputs = _static_fakes_as_meta(inputs)
        if device is None or not all(_is_meta_value(v) for v in inputs):
            return None
    else:
        try:
            flat = list(gm.graph.process_inputs(*example_inputs))
        except Exception:  # the FakeTensor path explains what does not fit
            return None
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        device = tensors[0].device if tensors else next((t.device for t in gm.parameters()), torch.device("cpu"))
        inputs, identity = flat, _ids(flat)
    if len(inputs) != len(placeholders) or device.type == "meta":
        return None
    if any(t.device != device for t in (*gm.parameters(), *gm.buffers())):
        return None
    if previous is not None and (previous.copies.env.device != device or previous.inputs != identity):
        previous = None
    copies = previous.copies if previous is not None else _MetaCopies(Env(device))
    out = MetaRecord(copies, identity)
    values: dict[fx.Node, Any] = {}
    changed: set[fx.Node] = set()
    position = iter(range(len(inputs)))
    try:
        with torch.no_grad():
            for node in nodes:
                key = _key(gm, node)
                if node.op == "placeholder":
                    value = inputs[next(position)]
                    if previous is not None and node in previous.values:  # the same inputs
                        value = previous.values[node]
                    elif example_inputs is not None:
                        value = copies.of_input(value)
                elif previous is not None and previous.reusable(node, key) and not changed.intersection(node._input_nodes):
                    value = previous.values[node]
                else:
                    args, kwargs = fx.map_arg((node.args, node.kwargs), values.__getitem__)
                    if node.op == "output":
                        value = args[0]
                    elif node.op == "get_attr":
                        value = copies.of_attribute(gm, node)
                    else:
                        value = evaluate(gm, node, args, kwargs, copies.env)
                if previous is None or previous.values.get(node, _MISSING) is not value:
                    changed.add(node)
                values[node] = value
                out.keys[node] = key
    except NoRule:
        return None
    out.values = values
    if record:  # every node whose recorded value is not this one (a reused value already is)
        for node, value in values.items():
            if node.meta.get("val", _MISSING) is not value:
                record_value(node, value)
        gm.meta[META_VALUES_DEVICE] = device
    return out


_MISSING = object()


def _static_fakes_as_meta(values: list[Any]) -> tuple[torch.device | None, list[Any]]:
    """The meta values standing for the placeholders' FakeTensors (torch.export's, make_fx's)
    when every one is a plain fake tensor of static shape on one device; (None, values)
    otherwise (symbolic shapes keep their fake mode: the FakeTensor path)."""
    if not values or not all(isinstance(v, FakeTensor) for v in values):
        return None, values
    devices = {v.device for v in values}
    if len(devices) != 1 or not all(type(n) is int for v in values for n in (*v.shape, *v.stride())):
        return None, values
    return devices.pop(), [torch.empty_strided(tuple(v.shape), v.stride(), dtype=v.dtype, device="meta",
                                               requires_grad=v.requires_grad) for v in values]


def _ids(inputs: list[Any]) -> tuple[int, ...]:
    return tuple(map(id, inputs))


def _key(gm: fx.GraphModule, node: fx.Node) -> tuple:
    """What a node's value depends on besides its inputs' values, compared by identity: its
    argument structures (fx replaces them whenever they change), and for a module call the
    module and the tensors it holds (a pass may swap either)."""
    if node.op != "call_module":
        return node._args, node._kwargs
    try:
        module = gm.get_submodule(node.target)
    except AttributeError:
        return node._args, node._kwargs
    return node._args, node._kwargs, module, *module._parameters.values(), *module._buffers.values()


@dataclass
class MetaRecord:
    """One rules propagation of a graph: each node's value and what it was computed from.

    The next propagation reuses a node's value when its key (:func:`_key`) holds the same
    objects, no input of it was computed again, and its ``meta['val']`` is still that value
    (a pass that wrote another one is believed). Attributes are re-read every time (cheap:
    their meta copies are kept here, one per tensor, so storage sharing stays consistent
    across propagations), so a weight swapped under the same name is seen."""

    copies: _MetaCopies
    #: the identities of the inputs propagated from
    inputs: tuple[int, ...]
    keys: dict[fx.Node, tuple] = field(default_factory=dict)
    values: dict[fx.Node, Any] = field(default_factory=dict)

    def reusable(self, node: fx.Node, key: tuple) -> bool:
        if node.op == "get_attr":
            return False
        old = self.keys.get(node)
        if old is None or len(old) != len(key) or not all(map(operator.is_, old, key)):
            return False
        value = self.values[node]
        return node.op == "output" or node.meta.get("val", _MISSING) is value


class _MetaCopies:
    """Meta copies of the real tensors a propagation starts from (example inputs, the
    graph's attributes), one per tensor, as FakeTensorMode memoizes its conversions; two
    distinct tensors that share a storage are refused (a FakeTensor run would show that
    sharing, separate meta copies would not)."""

    def __init__(self, env: Env):
        self.env = env
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.storages: set[StorageWeakRef] = set()

    def of_input(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy(value)
        if value is None or type(value) in (int, float, bool):
            return value
        raise NoRule("an input that is neither a tensor nor a number")

    def of_attribute(self, gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
        value: Any = gm
        try:
            for part in str(node.target).split("."):
                value = getattr(value, part)
        except AttributeError as exc:
            raise NoRule("a missing attribute") from exc
        if not isinstance(value, torch.Tensor):
            raise NoRule("an attribute that is not a tensor")
        return self._copy(value)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        known = self.copies.get(id(t))
        if known is not None and known[0] is t:
            return known[1]
        copy = meta_copy(self.env, t)
        storage = StorageWeakRef(t.untyped_storage())
        if storage in self.storages:
            raise NoRule("two tensors sharing a storage")
        self.storages.add(storage)
        self.copies[id(t)] = (t, copy)
        return copy


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
