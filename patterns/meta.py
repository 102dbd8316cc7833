"""``meta['val']`` for the nodes a rewrite creates, without running user code.

New nodes get their fake values by running their *targets* on fake copies of their inputs'
values, under the inputs' fake mode (a fresh one when the graph carries real tensors).
Only code torch (or fxopt) owns ever runs: ATen and prims overloads without a Python
fake kernel, fxopt's own ops,
callables torch exports (identified by identity, :func:`fxopt.analysis.ops.torch_name`),
``operator`` built-ins and public ``Tensor`` methods. Inputs are copied first, so an
in-place op never changes an existing node's metadata (a placeholder's least of all);
values of any other type (a user's class, a tensor subclass, a quantized tensor, a
cyclic container) are never touched, and fake tensors from two different modes are not
mixed. A node that cannot be evaluated that way has no ``meta['val']``, except that a
value annotated on a replacement graph's node is kept where its inputs are unchanged.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from fxopt.patterns.pattern import lookup_attr
from torch._library.simple_registry import singleton as _python_kernels
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.immutable_collections import immutable_dict, immutable_list

from fxopt.analysis.ops import torch_name
from fxopt.analysis.shapes import record_value


class _Unsafe(Exception):
    """A value or target that must not be touched."""


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.SymInt, torch.SymFloat, torch.SymBool)
_SEQUENCES = (list, tuple, immutable_list, torch.Size)
_MAPPINGS = (dict, immutable_dict)
_TRUSTED_NAMESPACES = ("aten", "prims")
_OWN_NAMESPACE = "fxopt"  # fxopt's own ops (torch.ops.fxopt.*): their fake kernels are ours


def _walk(value: Any, visit: Any, memo: dict[int, Any], active: set[int]) -> Any:
    """``value`` rebuilt with ``visit`` applied to its tensors; containers of exact
    built-in types only, shared containers stay shared, cycles are unsafe."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    key = id(value)
    if key in memo:
        return memo[key]
    if key in active:
        raise _Unsafe("cyclic value")
    if kind is FakeTensor or kind is torch.Tensor or kind is nn.Parameter:
        result = visit(value)
    elif kind in _SEQUENCES or kind in _MAPPINGS:
        active.add(key)
        if kind in _MAPPINGS:
            result = kind((_walk(k, visit, memo, active), _walk(v, visit, memo, active))
                          for k, v in dict.items(value))
        else:
            result = kind(_walk(v, visit, memo, active) for v in value)
        active.discard(key)
    else:
        raise _Unsafe(f"value of type {kind.__qualname__}")
    memo[key] = result
    return result


def _modes(values: Iterable[Any]) -> set[FakeTensorMode]:
    found: dict[int, FakeTensorMode] = {}

    def visit(t: torch.Tensor) -> torch.Tensor:
        if type(t) is FakeTensor:
            found[id(t.fake_mode)] = t.fake_mode
        return t

    for value in values:
        try:
            _walk(value, visit, {}, set())
        except _Unsafe:
            pass
    return set(found.values())


class _Copier:
    """Fake copies of input values, in one mode, aliases preserved across arguments."""

    def __init__(self, mode: FakeTensorMode):
        self.mode = mode
        self.memo: dict[int, Any] = {}

    def __call__(self, value: Any) -> Any:
        return _walk(value, self._tensor, self.memo, set())

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is FakeTensor:
            if t.fake_mode is not self.mode:
                raise _Unsafe("fake tensors of two modes")
            with self.mode:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        if t.is_quantized or t.layout is not torch.strided or t.is_nested:
            raise _Unsafe("unsupported tensor")
        return self.mode.from_tensor(t, static_shapes=True)


def _trusted_overload(op: torch._ops.OpOverload) -> bool:
    return op.namespace == _OWN_NAMESPACE or op.namespace in _TRUSTED_NAMESPACES and \
        _python_kernels.find(op._schema.name).fake_impl.kernel is None


def _safe_target(node: fx.Node) -> bool:
    target = node.target
    if node.op == "call_method":
        return type(target) is str and not target.startswith("_") and \
            callable(getattr(torch.Tensor, target, None))
    if node.op != "call_function":
        return False
    kind = type(target)
    if kind is torch._ops.OpOverload:
        return _trusted_overload(target)
    if kind is torch._ops.OpOverloadPacket:
        return all(
            _trusted_overload(getattr(target, o)) for o in target.overloads())
    if kind is types.BuiltinFunctionType and getattr(operator, getattr(target, "__name__", ""), None) is target:
        return True
    return torch_name(target) is not None


_SKIP = object()


def _evaluate(gm: fx.GraphModule, node: fx.Node, copy: _Copier, invalid: set[fx.Node]) -> Any:
    if node.op == "get_attr":
        value = lookup_attr(gm, node.target)
        return copy(value) if type(value) in (torch.Tensor, nn.Parameter) else _SKIP
    if not _safe_target(node) or any(i in invalid or "val" not in i.meta for i in node.all_input_nodes):
        return _SKIP
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: copy(n.meta["val"]))
    with copy.mode, torch.no_grad():
        if node.op == "call_method":
            if type(args[0]) is not FakeTensor:
                return _SKIP
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


def propagate_meta(gm: fx.GraphModule, created: list[fx.Node]) -> None:
    """Give the ``created`` nodes (in graph order) ``meta['val']`` / ``tensor_meta``;
    cheap when the graph carries no values (one look at each new node and its inputs)."""
    if not any("val" in n.meta or any("val" in i.meta for i in n.all_input_nodes) for n in created):
        return
    mine = set(created)
    inputs = [i for n in created for i in n.all_input_nodes if i not in mine]
    modes = _modes(i.meta.get("val") for i in inputs)
    # fake tensors of two modes cannot meet in one computation
    copy = None if len(modes) > 1 else _Copier(modes.pop() if modes else FakeTensorMode())
    invalid: set[fx.Node] = set()
    for node in created:
        value = _SKIP
        if copy is not None:
            try:
                value = _evaluate(gm, node, copy, invalid)
                _walk(value, lambda t: t, {}, set())  # a result we can store
            except Exception:  # an op fake tensors cannot run (data-dependent, bad inputs)
                value = _SKIP
        if value is not _SKIP:
            record_value(node, value)
        elif node.op in ("call_module", "get_attr") or "val" not in node.meta or \
                any(i in invalid for i in node.all_input_nodes) or copy is None:
            invalid.add(node)
            node.meta.pop("val", None)
            node.meta.pop("tensor_meta", None)
