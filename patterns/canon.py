"""One canonical identity per op: every spelling of an op reads as the same call.

``torch.relu(x)``, ``F.relu(x)``, ``x.relu()``, an ``nn.ReLU`` module, ``torch.relu_``
and ``torch.ops.aten.relu.default`` all canonicalize to ``Canon("relu", (x,))``; an
``nn.Conv2d`` module call, ``F.conv2d``, ``aten.conv2d`` and ``aten.convolution`` all read
as ``convolution(input, weight, bias, stride, padding, dilation, transposed,
output_padding, groups)`` with the module's parameters as :class:`ParamRef` arguments and
its attributes as literals. The matcher compares canonical forms, so a pattern written
once matches every spelling, at torch level (symbolic_trace, Dynamo) and at ATen level
(export, make_fx). The user's graph is never rewritten to get there: canonical forms are
computed on the side, when matching.

Ops outside the table still canonicalize, by their ATen base name with arguments bound
to their signature (schema or Python signature), so ``torch.sigmoid`` and ``x.sigmoid()``
meet, just without the cross-level normalization the table gives.
"""

from __future__ import annotations

import inspect
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxopt.analysis.ops import base_name, is_inplace_name, torch_name

aten = torch.ops.aten


@dataclass(frozen=True)
class ParamRef:
    """A parameter or buffer of a called module, standing as an argument of its canonical
    call (``conv.weight`` in ``convolution(x, conv.weight, ...)``); ``None`` attributes are
    plain ``None`` literals instead."""

    target: str  # qualified attribute path, usable as a get_attr target


@dataclass(slots=True)
class Canon:
    """The canonical reading of one node."""

    op: str
    args: tuple[Any, ...]
    #: the spelling writes into ``args[0]`` (``relu_``, ``inplace=True``, ``+=``)
    inplace: bool = False
    #: nodes that belong to this op besides the node itself (``native_batch_norm`` under
    #: the ``getitem(..., 0)`` that reads as ``batch_norm``)
    interior: tuple[fx.Node, ...] = field(default=())


_MISSING = object()


def _bind(args: Sequence[Any], kwargs: dict[str, Any], params: Sequence[tuple[str, Any]]) -> list[Any] | None:
    """Bind a call's arguments to ``params`` ((name, default) pairs; default _MISSING means
    required); None when they do not fit."""
    if not kwargs and len(args) == len(params):
        return list(args)
    if len(args) > len(params):
        return None
    values = list(args) + [_MISSING] * (len(params) - len(args))
    for i, (name, default) in enumerate(params):
        if name in kwargs:
            if i < len(args):
                return None
            values[i] = kwargs[name]
        elif values[i] is _MISSING:
            if default is _MISSING:
                return None
            values[i] = default
    if set(kwargs) - {name for name, _ in params}:
        return None
    return values


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _ntuple(value: Any, n: int) -> Any:
    if isinstance(value, fx.Node):  # a pattern's hole
        return value
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) == n else (list(value) * n if len(value) == 1 else None)
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n
    return None  # a string padding ("same"), a node: not canonical


# --- the table: spelling -> adapter(args, kwargs) -> (op, canonical args) or None -------

Adapter = Callable[[tuple, dict], "tuple[str, list] | None"]


def _unary(op: str, extra: Sequence[tuple[str, Any]] = ()) -> Adapter:
    params = [("self", _MISSING), *extra]

    def adapt(args: tuple, kwargs: dict) -> tuple[str, list] | None:
        if kwargs:
            kwargs = {("self" if k == "input" else k): v for k, v in kwargs.items() if k != "inplace"}
        bound = _bind(args, kwargs, params)
        return None if bound is None else (op, bound)

    adapt.op = op
    return adapt


def _binary(op: str, alpha: bool) -> Adapter:
    params = [("self", _MISSING), ("other", _MISSING)] + ([("alpha", 1)] if alpha else [])

    def adapt(args: tuple, kwargs: dict) -> tuple[str, list] | None:
        if kwargs:
            kwargs = {("self" if k == "input" else k): v for k, v in kwargs.items()}
        bound = _bind(args, kwargs, params)
        return None if bound is None else (op, bound)

    adapt.op = op
    return adapt


def _hardtanh(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    kwargs = {("self" if k == "input" else k): v for k, v in kwargs.items() if k != "inplace"}
    bound = _bind(args[:3], kwargs, [("self", _MISSING), ("min_val", -1.0), ("max_val", 1.0)])
    return None if bound is None else ("hardtanh", [bound[0], _float(bound[1]), _float(bound[2])])


def _float(value: Any) -> Any:
    """Numbers compare as floats (hardtanh(x, 0, 6) is hardtanh(x, 0.0, 6.0)); holes and
    wildcards pass through."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _relu6(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    kwargs = {("self" if k == "input" else k): v for k, v in kwargs.items() if k != "inplace"}
    bound = _bind(args[:1], kwargs, [("self", _MISSING)])
    return None if bound is None else ("hardtanh", [bound[0], 0.0, 6.0])


def _conv(dims: int, transposed: bool) -> Adapter:
    """F.conv{1,2,3}d / F.conv_transpose{1,2,3}d / aten.conv2d-style spellings."""
    if transposed:
        params = [("input", _MISSING), ("weight", _MISSING), ("bias", None), ("stride", 1),
                  ("padding", 0), ("output_padding", 0), ("groups", 1), ("dilation", 1)]
    else:
        params = [("input", _MISSING), ("weight", _MISSING), ("bias", None), ("stride", 1),
                  ("padding", 0), ("dilation", 1), ("groups", 1)]

    def adapt(args: tuple, kwargs: dict) -> tuple[str, list] | None:
        bound = _bind(args, kwargs, params)
        if bound is None:
            return None
        named = dict(zip((name for name, _ in params), bound))
        lists = [_ntuple(named[k], dims) for k in ("stride", "padding", "dilation")]
        output_padding = _ntuple(named.get("output_padding", 0), dims)
        if any(v is None for v in lists) or output_padding is None:
            return None
        return ("convolution", [named["input"], named["weight"], named["bias"], *lists,
                                transposed, output_padding, named["groups"]])

    adapt.op = "convolution"
    return adapt


def _convolution(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    bound = _bind(args, kwargs, [(n, _MISSING) for n in (
        "input", "weight", "bias", "stride", "padding", "dilation", "transposed",
        "output_padding", "groups")])
    if bound is None:
        return None
    bound[3:6] = [_as_list(v) for v in bound[3:6]]
    bound[7] = _as_list(bound[7])
    return ("convolution", bound)


_F_BATCH_NORM = [("input", _MISSING), ("running_mean", _MISSING), ("running_var", _MISSING),
                 ("weight", None), ("bias", None), ("training", False), ("momentum", 0.1),
                 ("eps", 1e-5)]
_ATEN_BATCH_NORM = [("input", _MISSING), ("weight", _MISSING), ("bias", _MISSING),
                    ("running_mean", _MISSING), ("running_var", _MISSING), ("training", _MISSING),
                    ("momentum", _MISSING), ("eps", _MISSING), ("cudnn_enabled", True)]


def _f_batch_norm(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    b = _bind(args, kwargs, _F_BATCH_NORM)
    return None if b is None else ("batch_norm", [b[0], b[3], b[4], b[1], b[2], b[5], b[6], b[7]])


def _aten_batch_norm(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    b = _bind(args, kwargs, _ATEN_BATCH_NORM)
    return None if b is None else ("batch_norm", b[:8])


def _linear(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    bound = _bind(args, kwargs, [("input", _MISSING), ("weight", _MISSING), ("bias", None)])
    return None if bound is None else ("linear", bound)


def _function_table() -> dict[Any, tuple[str, Adapter, bool]]:
    """callable target -> (canonical op, adapter, writes into its first argument)."""
    table: dict[Any, tuple[str, Adapter, bool]] = {}

    def add(targets: Sequence[Any], adapter: Adapter, inplace: bool = False) -> None:
        for t in targets:
            table[t] = (adapter.op, adapter, inplace)

    add([torch.relu, F.relu, aten.relu.default], _unary("relu"))
    add([torch.relu_, F.relu_, aten.relu_.default], _unary("relu"), inplace=True)
    add([F.hardtanh, aten.hardtanh.default], _hardtanh)
    add([F.hardtanh_, aten.hardtanh_.default], _hardtanh, inplace=True)
    add([F.relu6], _relu6)
    for name, alpha in (("add", True), ("sub", True), ("mul", False)):
        add([getattr(operator, name), getattr(torch, name), getattr(aten, name).Tensor,
             getattr(aten, name).Scalar], _binary(name, alpha))
        add([getattr(operator, "i" + name), getattr(aten, name + "_").Tensor,
             getattr(aten, name + "_").Scalar], _binary(name, alpha), inplace=True)
    for dims in (1, 2, 3):
        add([getattr(F, f"conv{dims}d"), getattr(torch, f"conv{dims}d"),
             getattr(aten, f"conv{dims}d").default], _conv(dims, False))
        add([getattr(F, f"conv_transpose{dims}d"), getattr(torch, f"conv_transpose{dims}d"),
             *(getattr(getattr(aten, f"conv_transpose{dims}d"), o)
               for o in getattr(aten, f"conv_transpose{dims}d").overloads())], _conv(dims, True))
    add([torch.convolution, aten.convolution.default], _convolution)
    add([F.batch_norm], _f_batch_norm)
    add([torch.batch_norm, aten.batch_norm.default], _aten_batch_norm)
    add([F.linear, torch._C._nn.linear, aten.linear.default], _linear)
    return table


for _adapter, _op in ((_hardtanh, "hardtanh"), (_relu6, "hardtanh"), (_convolution, "convolution"),
                      (_f_batch_norm, "batch_norm"), (_aten_batch_norm, "batch_norm"),
                      (_linear, "linear")):
    _adapter.op = _op

_FUNCTIONS = _function_table()
_METHODS: dict[str, tuple[str, Adapter, bool]] = {
    name: (adapter.op, adapter, name.endswith("_") and not name.startswith("__"))
    for name, adapter in (
        ("relu", _unary("relu")), ("relu_", _unary("relu")),
        ("add", _binary("add", True)), ("add_", _binary("add", True)),
        ("sub", _binary("sub", True)), ("sub_", _binary("sub", True)),
        ("mul", _binary("mul", False)), ("mul_", _binary("mul", False)),
        ("__add__", _binary("add", True)), ("__mul__", _binary("mul", False)),
        ("__sub__", _binary("sub", True)),
    )
}

#: functional activations whose ``inplace`` flag may come positionally
_POSITIONAL_INPLACE = {F.relu: 1, F.relu6: 1, F.hardtanh: 3}

# batch norm ops that return (out, save_mean, save_invstd): ``getitem(op, 0)`` is the op
_BN_TUPLE_OPS: dict[Any, Callable[[tuple, dict], list | None]] = {
    aten.native_batch_norm.default: lambda a, k: _aten_batch_norm(a, k),
    aten._native_batch_norm_legit.default: lambda a, k: _aten_batch_norm(a, k),
    aten._native_batch_norm_legit_no_training.default:
        lambda a, k: ("batch_norm", [*a[:5], False, *a[5:7]]) if len(a) == 7 and not k else None,
}


# --- modules ------------------------------------------------------------------------

class CalledModule:
    """A module called inside a pattern function, recorded as a call of this wrapper (a
    pattern has no module tree to install it in)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.__name__ = type(module).__name__.lower()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _param(owner: str | None, module: nn.Module, attr: str) -> Any:
    """``ParamRef`` for a module's tensor attribute; None stays None. In a pattern (no
    owner) module tensors cannot be referenced."""
    value = getattr(module, attr)
    if value is None:
        return None
    if owner is None:
        raise ValueError(f"{type(module).__name__} has tensor attribute {attr!r}")
    return ParamRef(f"{owner}.{attr}" if owner else attr)


def canonicalize_module(module: nn.Module, owner: str | None, args: tuple, kwargs: dict) -> Canon | None:
    """The canonical call an ``nn`` module performs, by type and attributes (never by the
    name it is installed under); None for modules outside the table."""
    if kwargs or len(args) != 1:
        return None
    (x,) = args
    inplace = bool(getattr(module, "inplace", False))
    if type(module) is nn.ReLU:
        return Canon("relu", (x,), inplace)
    if type(module) is nn.ReLU6:
        return Canon("hardtanh", (x, 0.0, 6.0), inplace)
    if type(module) is nn.Hardtanh:
        return Canon("hardtanh", (x, float(module.min_val), float(module.max_val)), inplace)
    if type(module) in (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                        nn.ConvTranspose3d):
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return None
        transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
        return Canon("convolution", (
            x, _param(owner, module, "weight"), _param(owner, module, "bias"),
            list(module.stride), list(module.padding), list(module.dilation), transposed,
            list(module.output_padding), module.groups))
    if type(module) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        # mirrors _BatchNorm.forward: without running stats, eval mode still uses batch stats
        training = module.training or (module.running_mean is None and module.running_var is None)
        use_stats = not module.training or module.track_running_stats
        momentum = 0.0 if module.momentum is None else module.momentum
        return Canon("batch_norm", (
            x, _param(owner, module, "weight"), _param(owner, module, "bias"),
            _param(owner, module, "running_mean") if use_stats else None,
            _param(owner, module, "running_var") if use_stats else None,
            training, momentum, module.eps))
    if type(module) is nn.Linear:
        return Canon("linear", (x, _param(owner, module, "weight"), _param(owner, module, "bias")))
    return _functional_form(module, owner, x)


def _functional(module_type: type) -> Callable | None:
    """The functional form of a ``torch.nn`` module class, found by name (``LeakyReLU`` ->
    ``F.leaky_relu``, ``SiLU`` -> ``F.silu``, ``LogSigmoid`` -> ``F.logsigmoid``,
    ``RMSNorm`` -> ``F.rms_norm``)."""
    if not module_type.__module__.startswith("torch.nn"):
        return None
    name = module_type.__name__
    for spelling in (name, name.replace("ReLU", "Relu")):
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", spelling).lower()
        for candidate in (snake, spelling.lower()):
            fn = getattr(F, candidate, None) or getattr(torch, candidate, None)
            if callable(fn) and not isinstance(fn, type):
                return fn
    return None


def _functional_form(module: nn.Module, owner: str | None, x: Any) -> Canon | None:
    """A torch.nn module as the call of its functional form, with the module's
    attributes (``negative_slope``, ``dim``, ``approximate``, ``eps``, ``weight``...)
    as the arguments of the same name."""
    fn = _functional(type(module))
    if fn is None:
        return None
    try:
        names = list(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):  # a builtin: the arguments of the ATen op of its name
        packet = getattr(aten, _base_name(fn) or "", None)
        names = [a.name for o in getattr(packet, "overloads", list)()
                 for a in getattr(packet, o)._schema.arguments[1:]]
    kwargs = {}
    for name in names:
        if name in module.__dict__.get("_parameters", {}) or name in module.__dict__.get("_buffers", {}):
            kwargs[name] = _param(owner, module, name)
        elif name in module.__dict__:
            kwargs[name] = module.__dict__[name]
    try:
        form = canonicalize_call(fn, (x,), kwargs)
    except ValueError:
        return None
    if form is not None and any(isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str)
                                for a in form.args[1:]):
        return None  # attributes that did not bind to the op's arguments
    return form


# --- the generic fallback -------------------------------------------------------------

def _base_name(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return torch_name(target) or getattr(target, "__name__", None)


def _python_binding(target: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A torch-level call's arguments as (positional, named), named as the ATen schema names
    them: ``input`` is ``self``; ``inplace`` and ``_stacklevel`` are not arguments of the op."""
    try:
        bound = inspect.signature(target).bind(*args, **kwargs).arguments
        args, kwargs = (), dict(bound)
    except (TypeError, ValueError):  # a builtin without a signature: keep the call as written
        kwargs = dict(kwargs)
    if "input" in kwargs:
        kwargs["self"] = kwargs.pop("input")
    for name in ("inplace", "_stacklevel"):
        kwargs.pop(name, None)
    return args, kwargs


def _aten_binding(name: str, args: tuple, kwargs: dict) -> list[Any] | None:
    """The arguments bound to the first overload of ``aten.<name>`` they fit (defaults
    filled in), so that every spelling of the op lists the same arguments."""
    packet = getattr(aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if schema.is_mutable and not name.endswith("_"):
            continue
        names = [a.name for a in schema.arguments]
        named = kwargs
        if "self" in kwargs and "self" not in names and "input" in names:  # aten.layer_norm
            named = {("input" if k == "self" else k): v for k, v in kwargs.items()}
        bound = _bind(args, named, [(a.name, a.default_value if a.has_default_value() else _MISSING)
                                    for a in schema.arguments])
        if bound is not None:
            return bound
    return None


def _generic(target: Any, args: tuple, kwargs: dict) -> Canon | None:
    """Ops outside the table: base name, trailing ``_`` meaning in place, and arguments
    bound to the ATen schema of that name (or the Python signature where there is none),
    so that module, functional, method and ATen spellings list the same arguments."""
    name = _base_name(target)
    if not name:
        return None
    inplace = is_inplace_name(name) or kwargs.get("inplace") is True
    if isinstance(target, torch._ops.OpOverload):
        bound = _bind(args, kwargs, [(a.name, a.default_value if a.has_default_value() else _MISSING)
                                     for a in target._schema.arguments])
    else:
        positional, named = _python_binding(target, args, kwargs)
        bound = _aten_binding(base_name(name), positional, named)
        if bound is None:
            bound = [*positional, *sorted(named.items())]
    if bound is None:
        return None
    return Canon(base_name(name), tuple(bound), inplace)


def canonicalize_call(target: Any, args: tuple, kwargs: dict, *, method: bool = False) -> Canon | None:
    """The canonical form of a call_function (or, with ``method``, call_method) node."""
    try:
        entry = _METHODS.get(target) if method else _FUNCTIONS.get(target)
    except TypeError:  # unhashable target
        entry = None
    if entry is not None:
        _, adapter, inplace = entry
        kwargs = dict(kwargs) if kwargs else {}
        position = None if method else _POSITIONAL_INPLACE.get(target)
        if position is not None and len(args) > position:
            kwargs["inplace"], args = args[position], args[:position]
        inplace = inplace or kwargs.get("inplace") is True
        result = adapter(tuple(args), kwargs)
        return None if result is None else Canon(result[0], tuple(result[1]), inplace)
    if method:
        func = getattr(torch, target, None) if isinstance(target, str) else None
        if func is None or not callable(func):
            return Canon(str(target), (*args, *sorted(kwargs.items())), str(target).endswith("_"))
        return _generic(func, tuple(args), dict(kwargs)) or Canon(target, tuple(args))
    if isinstance(target, CalledModule):  # a parameter-free module called inside a pattern
        return canonicalize_module(target.module, None, tuple(args), dict(kwargs))
    return _generic(target, tuple(args), dict(kwargs))


_TRANSPOSES = {aten.t.default, aten.permute.default, aten.transpose.int, aten.numpy_T.default}


def _transposed_source(value: Any) -> fx.Node | None:
    """``w`` if ``value`` is the node ``aten.t(w)`` (or its permute/transpose spelling)."""
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target in _TRANSPOSES):
        return None
    extra = value.args[1:]
    if value.target is aten.permute.default and list(extra[0]) != [1, 0]:
        return None
    if value.target is aten.transpose.int and sorted(d % 2 for d in extra) != [0, 1]:
        return None
    return value.args[0] if isinstance(value.args[0], fx.Node) else None


def _aten_linear(node: fx.Node) -> Canon | None:
    """make_fx spells ``linear`` as ``addmm(b, x, t(w))`` (or ``mm(x, t(w))``): read it back,
    with the transpose as part of the op."""
    if node.kwargs and any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return None
    if node.target is aten.addmm.default and len(node.args) == 3:
        bias, x, wt = node.args
    elif node.target is aten.mm.default and len(node.args) == 2:
        (x, wt), bias = node.args, None
    else:
        return None
    weight = _transposed_source(wt)
    if weight is None or (isinstance(bias, fx.Node) and bias.meta.get("val") is not None
                          and bias.meta["val"].dim() != 1):
        return None
    return Canon("linear", (x, weight, bias), False, (wt,))


def canonicalize(node: fx.Node) -> Canon | None:
    """The canonical form of ``node``; None for placeholders, outputs and get_attr."""
    if node.op == "call_function" and node.target in (aten.addmm.default, aten.mm.default):
        linear = _aten_linear(node)
        if linear is not None:
            return linear
    if node.op == "call_function":
        if node.target is operator.getitem and node.args[1:] == (0,) and isinstance(node.args[0], fx.Node):
            source = node.args[0]
            adapter = _BN_TUPLE_OPS.get(source.target) if source.op == "call_function" else None
            if adapter is not None:
                result = adapter(tuple(source.args), dict(source.kwargs))
                if result is not None:
                    return Canon(result[0], tuple(result[1]), False, (source,))
        return canonicalize_call(node.target, node.args, node.kwargs)
    if node.op == "call_method":
        return canonicalize_call(node.target, node.args, node.kwargs, method=True)
    if node.op == "call_module":
        owner = node.graph.owning_module
        try:
            module = owner.get_submodule(node.target) if owner is not None else None
        except AttributeError:
            return None
        if module is None:
            return None
        return canonicalize_module(module, node.target, tuple(node.args), dict(node.kwargs)) or Canon(
            f"module:{type(module).__module__}.{type(module).__qualname__}",
            (*node.args, *sorted(node.kwargs.items())))
    return None


def quick_op(node: fx.Node) -> str | None:
    """The canonical op name of ``node`` without binding its arguments: the cheap key the
    matcher indexes anchors by (the full canonical form is computed only for candidates)."""
    if node.op == "call_module" or node.op == "call_function" and _spans(node.target):
        canon = canonicalize(node)
        if canon is not None:
            return canon.op
    if node.op == "call_function":
        try:
            entry = _FUNCTIONS.get(node.target)
        except TypeError:
            return None
        if entry is not None:
            return entry[0]
        if isinstance(node.target, CalledModule):
            canon = canonicalize(node)
            return canon.op if canon else None
        name = _base_name(node.target)
        return name.rstrip("_") if name and name.endswith("_") and not name.startswith("_") else name
    if node.op == "call_method":
        if node.target in _METHODS:
            return _METHODS[node.target][0]
        return node.target.rstrip("_") if node.target.endswith("_") else node.target
    return None


#: targets whose canonical op depends on their inputs (a getitem of a batch norm is one)
_SPANNING = frozenset({operator.getitem, aten.addmm.default, aten.mm.default})


def _spans(target: Any) -> bool:
    try:
        return target in _SPANNING
    except TypeError:
        return False
