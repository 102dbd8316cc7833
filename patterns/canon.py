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

Which op a call performs, and whether the spelling writes in place, is the op-facts
model's answer (:mod:`fxopt.analysis.ops`: ``op_name``, ``spelled_inplace``,
``functional_form``); this module only binds the arguments to the op's ATen schema, so
every spelling lists the same arguments, and brings a few ops whose spellings differ in
more than names into one form (the adapters below).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fxopt.analysis.ops import (
    base_name,
    functional_form,
    is_inplace_name,
    may_spell_inplace,
    op_name,
    signature_of,
    spelled_inplace,
)

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


# --- argument adapters: ops whose spellings differ in more than names ----------------
#
# Which op a call is (its name, whether it writes in place) is the op-facts model's answer
# (:func:`fxopt.analysis.ops.op_name`, :func:`~fxopt.analysis.ops.spelled_inplace`);
# the adapters below only bring the arguments of a few ops into one form, keyed by that
# name: ``relu6`` is ``hardtanh(x, 0, 6)``, every convolution is ``convolution`` with
# list arguments, ``F.batch_norm`` orders its arguments unlike ``aten.batch_norm``,
# ``selu`` is ``elu`` with fixed constants, ``aten._softmax`` is ``softmax``.

Adapter = Callable[[Any, tuple, dict], "tuple[str, list] | None"]


def _self(kwargs: dict) -> dict:
    """Keyword arguments as the ATen schema names them (``input`` is ``self``), without
    the ``inplace`` flag (the spelling, not an argument)."""
    return {("self" if k == "input" else k): v for k, v in kwargs.items() if k != "inplace"}


def _hardtanh(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
    bound = _bind(args[:3], _self(kwargs), [("self", _MISSING), ("min_val", -1.0), ("max_val", 1.0)])
    return None if bound is None else ("hardtanh", [bound[0], _float(bound[1]), _float(bound[2])])


def _float(value: Any) -> Any:
    """Numbers compare as floats (hardtanh(x, 0, 6) is hardtanh(x, 0.0, 6.0)); holes and
    wildcards pass through."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _relu6(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
    bound = _bind(args[:1], _self(kwargs), [("self", _MISSING)])
    return None if bound is None else ("hardtanh", [bound[0], 0.0, 6.0])


#: torch.nn.functional.selu's constants (torch/csrc/api/include/torch/nn/functional/activation.h)
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772, 1.0507009873554805


def _selu(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
    bound = _bind(args[:1], _self(kwargs), [("self", _MISSING)])
    return None if bound is None else ("elu", [bound[0], _SELU_ALPHA, _SELU_SCALE, 1])


def _square(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
    """``torch.square(x)`` is ``x ** 2`` (what make_fx records)."""
    bound = _bind(args, _self(kwargs), [("self", _MISSING)])
    return None if bound is None else ("pow", [bound[0], 2])


def _logsigmoid(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
    """``F.logsigmoid`` is exported under that name; ATen calls it ``log_sigmoid``."""
    bound = _bind(args, _self(kwargs), [("self", _MISSING)])
    return None if bound is None else ("log_sigmoid", bound)


def _private_softmax(op: str) -> Adapter:
    """``aten._softmax(x, dim, half_to_float)``, what decompositions call, is ``softmax``."""
    def adapt(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
        bound = _bind(args, kwargs, [("self", _MISSING), ("dim", _MISSING), ("half_to_float", _MISSING)])
        if bound is None:
            return None
        return (op, [bound[0], bound[1], torch.float32 if bound[2] else None])

    return adapt


def _conv(dims: int, transposed: bool) -> Adapter:
    """F.conv{1,2,3}d / F.conv_transpose{1,2,3}d / aten.conv2d-style spellings."""
    if transposed:
        params = [("input", _MISSING), ("weight", _MISSING), ("bias", None), ("stride", 1),
                  ("padding", 0), ("output_padding", 0), ("groups", 1), ("dilation", 1)]
    else:
        params = [("input", _MISSING), ("weight", _MISSING), ("bias", None), ("stride", 1),
                  ("padding", 0), ("dilation", 1), ("groups", 1)]

    def adapt(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
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

    return adapt


def _convolution(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
    bound = _bind(args, kwargs, [(n, _MISSING) for n in (
        "input", "weight", "bias", "stride", "padding", "dilation", "transposed",
        "output_padding", "groups")])
    if bound is None:
        return None
    bound[3:6] = [_as_list(v) for v in bound[3:6]]
    bound[7] = _as_list(bound[7])
    return ("convolution", bound)


#: F.batch_norm's order (a Python function); torch.batch_norm / aten.batch_norm's order
_F_BATCH_NORM = [("input", _MISSING), ("running_mean", _MISSING), ("running_var", _MISSING),
                 ("weight", None), ("bias", None), ("training", False), ("momentum", 0.1),
                 ("eps", 1e-5)]
_ATEN_BATCH_NORM = [("input", _MISSING), ("weight", _MISSING), ("bias", _MISSING),
                    ("running_mean", _MISSING), ("running_var", _MISSING), ("training", _MISSING),
                    ("momentum", _MISSING), ("eps", _MISSING), ("cudnn_enabled", True)]


def _batch_norm(target: Any, args: tuple, kwargs: dict) -> tuple[str, list] | None:
    params = _F_BATCH_NORM if _python_parameters(target)[:2] == ["input", "running_mean"] else _ATEN_BATCH_NORM
    bound = _bind(args, kwargs, params)
    if bound is None:
        return None
    named = dict(zip((name for name, _ in params), bound))
    return ("batch_norm", [named[name] for name, _ in _ATEN_BATCH_NORM[:8]])


def _python_parameters(target: Any) -> list[str]:
    signature = signature_of(target)
    return [] if signature is None else list(signature.parameters)


_ADAPTERS: dict[str, Adapter] = {
    "hardtanh": _hardtanh, "relu6": _relu6, "selu": _selu, "logsigmoid": _logsigmoid, "square": _square,
    "_softmax": _private_softmax("softmax"), "_log_softmax": _private_softmax("log_softmax"),
    "convolution": _convolution, "_convolution": _convolution, "batch_norm": _batch_norm,
    **{f"conv{d}d": _conv(d, False) for d in (1, 2, 3)},
    **{f"conv_transpose{d}d": _conv(d, True) for d in (1, 2, 3)},
}
#: the canonical op each adapter produces (for the cheap anchor index)
_ADAPTED_OP = {"hardtanh": "hardtanh", "relu6": "hardtanh", "selu": "elu", "logsigmoid": "log_sigmoid",
               "square": "pow", "_softmax": "softmax",
               "_log_softmax": "log_softmax", "batch_norm": "batch_norm",
               **dict.fromkeys(("convolution", "_convolution", *(f"conv{d}d" for d in (1, 2, 3)),
                                *(f"conv_transpose{d}d" for d in (1, 2, 3))), "convolution")}

# ops returning a tuple whose element 0 is the op of another name (``getitem(op, 0)``)
_TUPLE_OPS: dict[str, Callable[[tuple, dict], tuple[str, list] | None]] = {
    "native_batch_norm": lambda a, k: _batch_norm(None, a, k),
    "_native_batch_norm_legit": lambda a, k: _batch_norm(None, a, k),
    "_native_batch_norm_legit_no_training":
        lambda a, k: ("batch_norm", [*a[:5], False, *a[5:7]]) if len(a) == 7 and not k else None,
    "log_sigmoid_forward": lambda a, k: ("log_sigmoid", [a[0]]) if len(a) == 1 and not k else None,
    "native_layer_norm": lambda a, k: ("layer_norm", [a[0], _as_list(a[1]), *a[2:5], None])
    if len(a) == 5 and not k else None,
    "native_group_norm": lambda a, k: ("group_norm", [a[0], a[6], a[1], a[2], a[7], None])
    if len(a) == 8 and not k else None,
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


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def canonicalize_module(module: nn.Module, owner: str | None, args: tuple, kwargs: dict) -> Canon | None:
    """The canonical call an ``nn`` module performs, by type and attributes (never by the
    name it is installed under); None for modules that are not torch's."""
    if kwargs or len(args) != 1:
        return None
    (x,) = args
    if type(module) in _CONVS:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return None
        transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
        return Canon("convolution", (
            x, _param(owner, module, "weight"), _param(owner, module, "bias"),
            list(module.stride), list(module.padding), list(module.dilation), transposed,
            list(module.output_padding), module.groups))
    if type(module) in _BATCH_NORMS:
        # mirrors _BatchNorm.forward: without running stats, eval mode still uses batch stats
        training = module.training or (module.running_mean is None and module.running_var is None)
        use_stats = not module.training or module.track_running_stats
        momentum = 0.0 if module.momentum is None else module.momentum
        return Canon("batch_norm", (
            x, _param(owner, module, "weight"), _param(owner, module, "bias"),
            _param(owner, module, "running_mean") if use_stats else None,
            _param(owner, module, "running_var") if use_stats else None,
            training, momentum, module.eps))
    return _functional_form(module, owner, x)


def _functional_form(module: nn.Module, owner: str | None, x: Any) -> Canon | None:
    """A torch.nn module as the call of its functional form
    (:func:`fxopt.analysis.ops.functional_form`), with the module's attributes
    (``negative_slope``, ``dim``, ``approximate``, ``eps``, ``inplace``, ``weight``...) as
    the arguments of the same name."""
    fn = functional_form(type(module))
    if fn is None:
        return None
    names = _python_parameters(fn)[1:]
    if not names:  # a builtin: the arguments of the ATen op of its name
        packet = getattr(aten, op_name(fn) or "", None)
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


# --- binding arguments ----------------------------------------------------------------

def _python_binding(target: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A torch-level call's arguments as (positional, named), named as the ATen schema names
    them: ``input`` is ``self``; ``inplace`` and ``_stacklevel`` are not arguments of the op."""
    # operator.add(a, b) binds by position; a builtin without a signature as written
    signature = None if getattr(target, "__module__", None) == "_operator" else signature_of(target)
    try:
        if signature is None:
            raise TypeError
        args, kwargs = (), dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        kwargs = dict(kwargs)
    if "input" in kwargs:
        kwargs["self"] = kwargs.pop("input")
    for name in ("inplace", "_stacklevel"):
        kwargs.pop(name, None)
    return args, kwargs


@dataclass(frozen=True)
class _Schema:
    """An ATen schema as binding needs it, computed once per overload."""

    params: tuple[tuple[str, Any], ...]  # (name, default or _MISSING)
    hints: tuple[int, ...]  # positions of backend hints
    input_named: bool  # calls its first argument ``input`` (aten.layer_norm), not ``self``

    def bind(self, args: tuple, kwargs: dict) -> list[Any] | None:
        if self.input_named and "self" in kwargs:
            kwargs = {("input" if k == "self" else k): v for k, v in kwargs.items()}
        bound = _bind(args, kwargs, self.params)
        if bound is not None:
            for i in self.hints:
                bound[i] = None
        return bound


_SCHEMAS: dict[Any, _Schema] = {}


def _schema(overload: torch._ops.OpOverload) -> _Schema:
    found = _SCHEMAS.get(overload)
    if found is None:
        arguments = overload._schema.arguments
        names = [a.name for a in arguments]
        found = _SCHEMAS[overload] = _Schema(
            tuple((a.name, a.default_value if a.has_default_value() else _MISSING) for a in arguments),
            tuple(i for i, n in enumerate(names) if n in _BACKEND_HINTS),
            "input" in names and "self" not in names)
    return found


_PACKETS: dict[str, tuple[_Schema, ...]] = {}


def _packet(name: str) -> tuple[_Schema, ...]:
    """The schemas of ``aten.<name>``'s overloads a call of that name may mean (mutable
    ones only for in-place names), in torch's order."""
    found = _PACKETS.get(name)
    if found is None:
        packet = getattr(aten, name, None)
        overloads = [getattr(packet, o) for o in packet.overloads()] if isinstance(
            packet, torch._ops.OpOverloadPacket) else []
        found = _PACKETS[name] = tuple(_schema(o) for o in overloads
                                       if not o._schema.is_mutable or is_inplace_name(name))
    return found


def _aten_binding(name: str, args: tuple, kwargs: dict) -> list[Any] | None:
    """The arguments bound to the first overload of ``aten.<name>`` they fit (defaults
    filled in), so that every spelling of the op lists the same arguments."""
    for schema in _packet(name):
        bound = schema.bind(args, kwargs)
        if bound is not None:
            return bound
    return None


#: arguments that choose a kernel, not a result (``layer_norm(..., cudnn_enable)``): every
#: spelling reads them as None
_BACKEND_HINTS = frozenset({"cudnn_enable", "cudnn_enabled"})


def _arguments(target: Any, name: str, args: tuple, kwargs: dict, method: bool) -> list[Any]:
    """The call's arguments in the order of the ATen schema of ``name`` (defaults filled
    in), so that module, functional, method and ATen spellings list the same arguments;
    as written (named ones sorted) for ops without a schema."""
    if isinstance(target, torch._ops.OpOverload):
        bound = _schema(target).bind(args, kwargs)
        if bound is not None:
            return bound
    positional, named = (args, dict(kwargs)) if method else _python_binding(target, args, kwargs)
    bound = _aten_binding(base_name(name), positional, named)
    return bound if bound is not None else [*positional, *sorted(named.items())]


def canonicalize_call(target: Any, args: tuple, kwargs: dict, *, method: bool = False) -> Canon | None:
    """The canonical form of a call_function (or, with ``method``, call_method) node: the
    op-facts model names the op and says whether this spelling writes in place; the
    arguments are bound to the op's schema (or brought into form by an adapter)."""
    if isinstance(target, CalledModule):  # a parameter-free module called inside a pattern
        return canonicalize_module(target.module, None, tuple(args), dict(kwargs))
    args, kwargs = tuple(args), dict(kwargs) if kwargs else {}
    plan = _call_plan(target, method, args, kwargs)
    if plan is None:
        return None
    inplace = plan.may_write and spelled_inplace(None if method else target, plan.name, args, kwargs)
    if plan.adapter is not None:
        adapted = plan.adapter(target, args, kwargs)
        return None if adapted is None else Canon(adapted[0], tuple(adapted[1]), inplace)
    if plan.defaults is not None:  # the usual call: its positional arguments, then defaults
        bound = args + plan.defaults
    elif plan.arguments is None:
        bound = tuple(_arguments(target, plan.name, args, kwargs, method))
    else:
        bound = tuple([args[v] if how == _ARG else kwargs[v] if how == _KEYWORD else v
                       for how, v in plan.arguments])
    return Canon(plan.base, bound, inplace)


@dataclass(frozen=True, slots=True)
class _CallPlan:
    """How the calls of one target with one argument layout (how many positional
    arguments, which keywords) read, worked out once: the op-facts model's name for the
    op, its out-of-place name, whether a call of this layout can write in place at all
    (only then is the op-facts model asked per call), the argument adapter, and where
    each canonical argument comes from (the binding depends only on the layout, so it is
    worked out on placeholders, :class:`_Slot`, and filled in)."""

    name: str
    base: str
    may_write: bool
    adapter: Adapter | None
    #: (how, what) per canonical argument; None: bound per call (an adapter's op, a
    #: binding that nests arguments: ``*args`` functions, ops without a schema)
    arguments: tuple[tuple[int, Any], ...] | None
    #: where ``arguments`` are the call's positional arguments in order followed by
    #: constants only (``operator.add(x, y)`` is ``add(x, y, 1)``): those constants, so
    #: the canonical arguments are one concatenation instead of a fill per argument
    defaults: tuple[Any, ...] | None = None


#: how a plan fills one canonical argument: from a position, from a keyword, a constant
_ARG, _KEYWORD, _CONSTANT = 0, 1, 2
_CALL_PLANS: dict[tuple, _CallPlan | None] = {}


def _call_plan(target: Any, method: bool, args: tuple, kwargs: dict) -> _CallPlan | None:
    """The plan for this call's target and layout; None when the target is not an op."""
    key = (target, method, len(args), *kwargs)
    try:
        return _CALL_PLANS[key]
    except KeyError:
        found = _CALL_PLANS[key] = _make_plan(target, method, (len(args), tuple(kwargs)))
        return found
    except TypeError:  # an unhashable target: bound per call
        return _make_plan(target, method, None)


def _make_plan(target: Any, method: bool, layout: tuple[int, tuple[str, ...]] | None) -> _CallPlan | None:
    name = op_name(target, method=method)
    if name is None:
        return None
    base = base_name(name)
    adapter = _ADAPTERS.get(base)
    arguments = None if adapter is not None or layout is None else _argument_plan(target, name, *layout, method)
    may_write = True if layout is None else may_spell_inplace(None if method else target, name, *layout)
    defaults = None if layout is None else _trailing_defaults(arguments, layout[0])
    return _CallPlan(name, base, may_write, adapter, arguments, defaults)


def _trailing_defaults(arguments: tuple[tuple[int, Any], ...] | None, n_args: int) -> tuple[Any, ...] | None:
    """The constants after the call's ``n_args`` positional arguments when ``arguments``
    (a plan) is exactly those arguments in order and then constants; else None."""
    if arguments is None or len(arguments) < n_args:
        return None
    head, tail = arguments[:n_args], arguments[n_args:]
    if not all(how == _ARG and key == i for i, (how, key) in enumerate(head)):
        return None
    if not all(how == _CONSTANT for how, _ in tail):
        return None
    return tuple(value for _, value in tail)


@dataclass(frozen=True)
class _Slot:
    """Stands for the call's argument ``key`` (a position or a keyword) while a plan is made."""

    key: int | str


def _argument_plan(target: Any, name: str, n_args: int, keywords: tuple[str, ...],
                   method: bool) -> tuple[tuple[int, Any], ...] | None:
    """(how, what) per canonical argument of a call with this layout, None when the binding
    nests arguments in containers (then it cannot be filled in by position)."""
    slots = _arguments(target, name, tuple(_Slot(i) for i in range(n_args)),
                       {k: _Slot(k) for k in keywords}, method)
    if not all(type(v) is _Slot or not _holds_slot(v) for v in slots):
        return None
    return tuple(((_ARG if type(v.key) is int else _KEYWORD), v.key) if type(v) is _Slot else (_CONSTANT, v)
                 for v in slots)


def _holds_slot(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(type(v) is _Slot or _holds_slot(v) for v in value)
    return isinstance(value, dict) and any(_holds_slot(v) for v in value.values())


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


def _spanning_form(node: fx.Node) -> Canon | None:
    """The op a node spells together with its input: ``linear`` from make_fx's
    ``addmm(b, x, t(w))``, ``batch_norm`` from ``getitem(native_batch_norm(...), 0)``."""
    if node.target is not operator.getitem:
        return _aten_linear(node)
    if node.args[1:] != (0,) or not isinstance(node.args[0], fx.Node):
        return None
    source = node.args[0]
    adapter = _TUPLE_OPS.get(op_name(source.target) or "") if source.op == "call_function" else None
    result = None if adapter is None else adapter(tuple(source.args), dict(source.kwargs))
    return None if result is None else Canon(result[0], tuple(result[1]), False, (source,))


def canonicalize(node: fx.Node) -> Canon | None:
    """The canonical form of ``node``; None for placeholders, outputs and get_attr."""
    if node.op == "call_function":
        spanning = _spanning_form(node) if _spans(node.target) else None
        return spanning or canonicalize_call(node.target, node.args, node.kwargs)
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
            _opaque_op(type(module)), (*node.args, *sorted(node.kwargs.items())))
    return None


def _opaque_op(module_type: type) -> str:
    """The op of a module call that has no canonical form: the module's class."""
    return f"module:{module_type.__module__}.{module_type.__qualname__}"


def module_ops(module_type: type) -> frozenset[str] | None:
    """Every op a call of a ``module_type`` module can canonicalize to, whatever its
    attributes and arguments (None where that is not known without its form): the op
    :func:`canonicalize_module` gives the type, and the opaque op of the calls it leaves
    alone (a padding mode, a keyword argument). Mirrors :func:`canonicalize_module` type
    by type, so that a module call needs its form only where a rule may anchor there."""
    opaque = _opaque_op(module_type)
    if module_type in _CONVS:
        return frozenset({"convolution", opaque})
    if module_type in _BATCH_NORMS:
        return frozenset({"batch_norm", opaque})
    fn = functional_form(module_type)
    if fn is None:
        return frozenset({opaque})
    op = _op_of(fn, False)  # the op canonicalize_call names for fn
    if op is None:
        return frozenset({opaque})
    return frozenset({op, opaque}) if isinstance(op, str) else None


def quick_op(node: fx.Node) -> str | None:
    """The canonical op name of ``node`` without binding its arguments: the cheap key the
    matcher indexes anchors by (the full canonical form is computed only for candidates,
    and for the few spellings whose op depends on more than the target)."""
    if node.op == "call_module":
        return _form_op(node)
    if node.op not in ("call_function", "call_method"):
        return None
    key = (node.target, node.op == "call_method")
    try:
        op = _QUICK[key]
    except KeyError:
        op = _QUICK[key] = _op_of(*key)
    except TypeError:  # an unhashable target
        op = _op_of(*key)
    return _form_op(node) if op is _BY_FORM else op


class AnchorOps:
    """:func:`quick_op` for the nodes that may be the anchor of a rule anchored at one of
    ``ops``, None for the others: a module call whose type can canonicalize to none of
    them (:func:`module_ops`) is not canonicalized, which is most of the cost of a sweep
    over a graph of module calls that no rule anchors at (linears, layer norms under an
    index of relu and batch_norm). Made per application of rules, not kept: the answer
    per module type lives as long as the rule index, and the module is looked up at
    each call, so a module replaced in between is read as it is now."""

    def __init__(self, ops: Collection[str]):
        self.ops = ops
        self.types: dict[type, bool] = {}  # module type -> whether it may be in ops

    def __call__(self, node: fx.Node) -> str | None:
        if node.op == "call_module":
            owner = node.graph.owning_module
            if owner is None:
                return None  # no module, no form (as canonicalize reads it)
            try:
                kind = type(owner.get_submodule(node.target))
            except AttributeError:
                return None
            may = self.types.get(kind)
            if may is None:
                ops = module_ops(kind)
                may = self.types[kind] = ops is None or not ops.isdisjoint(self.ops)
            if not may:
                return None
        return quick_op(node)


def _form_op(node: fx.Node) -> str | None:
    canon = canonicalize(node)
    return None if canon is None else canon.op


#: the op is read off the node's canonical form (spellings spanning two nodes, modules)
_BY_FORM = object()
#: (target, is a method) -> op name, None or _BY_FORM
_QUICK: dict[tuple[Any, bool], Any] = {}


def _op_of(target: Any, method: bool) -> Any:
    if not method and (_spans(target) or isinstance(target, CalledModule)):
        return _BY_FORM
    name = op_name(target, method=method)
    if name is None:
        return None
    base = base_name(name)
    return _ADAPTED_OP.get(base, base)


#: targets whose canonical op depends on their inputs (a getitem of a batch norm is one)
_SPANNING = frozenset({operator.getitem, aten.addmm.default, aten.mm.default})


def _spans(target: Any) -> bool:
    try:
        return target in _SPANNING
    except TypeError:
        return False
