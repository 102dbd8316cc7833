"""``meta['val']`` for the nodes a rewrite creates: FakeTensor propagation that runs only
torch's own code.

New nodes get their values the way FakeTensor propagation of the whole graph would give
them: their targets run under the inputs' fake mode, *on the inputs' own fake values*, so
a view of an input (``reshape``, ``view``, ``x[:, 0]``) shares that input's fake storage.
Real tensors in the graph become fake tensors of one fresh mode per graph (the same real
tensor is the same fake tensor in every rewrite, so aliases between rewrites survive too).
An op that writes in place runs on fresh fake copies of its inputs instead, so an existing
node's metadata (a placeholder's least of all) never changes.

Only code torch (or fxopt) owns ever runs:

- targets: ATen, torch's own prims and fxopt's ops, callables torch exports (by identity,
  :func:`fxopt.analysis.ops.torch_name`), ``operator`` built-ins, and public ``Tensor``
  methods implemented by torch (not one a user patched onto ``torch.Tensor``);
- every op actually dispatched is checked as it is reached (:class:`_TorchCodeOnly`): no
  Python fake kernel, fake-mode rule or kernel (a Meta override, say) registered for it by
  anyone but torch, no data-dependent output (which would add unbacked symbols to the
  graph's shape environment);
- while values are computed, the user's dispatch modes are off, the fake mode may not fall
  back to running real kernels, and the shape environment refuses new guards (an op that
  would need one gets no value rather than changing what the graph assumes). These
  settings belong to a mode other code may share, so evaluation is serialized by a lock
  (and holds the mode's own lock, :mod:`fxopt.analysis.fake_lock`, which shape
  propagation takes too) and the settings are always put back.

Values of any other type (a user's class, a tensor subclass, a quantized or nested tensor,
a cyclic container) are never touched, and fake tensors of two modes are not mixed. A
node that cannot be evaluated this way has no ``meta['val']``, except that a value
annotated on a replacement graph's node is kept where its inputs are unchanged.

A graph whose values are meta values (fxopt's shape rules, :mod:`fxopt.analysis.shapes`)
gets them the same way for its new nodes: by the rules, never by a fake mode, so the two
kinds of value never meet in one graph; a new node without a rule has no value.
"""

from __future__ import annotations

import operator
import os
import re
import threading
import types
import weakref
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch._prims  # noqa: F401 - torch's prims, whose fake kernels are torch's own
import torch.fx as fx
import torch.nn as nn
from fxopt.patterns.pattern import lookup_attr
from torch._library.simple_registry import singleton as _python_kernels
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fxopt.analysis.fake_lock import fake_mode_lock
from fxopt.analysis.ops import mutated_inputs, torch_name
from fxopt.analysis.shape_rules import Env, NoRule, evaluate, has_rule, meta_copy
from fxopt.analysis.shapes import META_VALUES_DEVICE, record_value


class _Unsafe(Exception):
    """A value or target that must not be touched."""


def _ids(*kinds: type) -> frozenset[int]:
    # types are compared by identity: a user's metaclass never sees __eq__ or __hash__
    return frozenset(id(k) for k in kinds)


_PLAIN = _ids(int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
              torch.memory_format, torch.SymInt, torch.SymFloat, torch.SymBool)
_SEQUENCES = _ids(list, tuple, immutable_list, torch.Size)
_MAPPINGS = _ids(dict, immutable_dict)
_TENSORS = _ids(FakeTensor, torch.Tensor, nn.Parameter)
_OWN_NAMESPACE = "fxopt"  # fxopt's own ops (torch.ops.fxopt.*): their fake kernels are ours
#: ops whose output shape or value depends on data: a fake run invents unbacked symbols
_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
#: a dispatcher table line of an active kernel (or of the schema, ``debug``), with the file
#: that registered it
_ACTIVE_KERNEL = re.compile(r"^[\w\[\]]+: registered at (.+?):\d+")
_TORCH_DIR = os.path.normpath(os.path.dirname(torch.__file__)) + os.sep
#: torch.library's own files: what they register, they register on a caller's behalf
_TORCH_REGISTRARS = (os.path.join(_TORCH_DIR, "library.py"), os.path.join(_TORCH_DIR, "_library") + os.sep)
_C_METHODS = (types.MethodDescriptorType, types.WrapperDescriptorType, types.BuiltinFunctionType)


def _walk(value: Any, visit: Any, memo: dict[int, Any], active: set[int]) -> Any:
    """``value`` rebuilt with ``visit`` applied to its tensors; containers of exact
    built-in types only, shared containers stay shared, cycles are unsafe."""
    kind = id(type(value))
    if kind in _PLAIN:
        return value
    key = id(value)
    if key in memo:
        return memo[key]
    if key in active:
        raise _Unsafe("cyclic value")
    if kind in _TENSORS:
        result = visit(value)
    elif kind in _SEQUENCES or kind in _MAPPINGS:
        active.add(key)
        if kind in _MAPPINGS:
            result = type(value)((_walk(k, visit, memo, active), _walk(v, visit, memo, active))
                                 for k, v in dict.items(value))
        else:
            result = type(value)(_walk(v, visit, memo, active) for v in value)
        active.discard(key)
    else:
        raise _Unsafe("value of an unsupported type")
    memo[key] = result
    return result


def _modes(values: Iterable[Any]) -> list[FakeTensorMode]:
    found: dict[int, FakeTensorMode] = {}

    def visit(t: torch.Tensor) -> torch.Tensor:
        if type(t) is FakeTensor:
            found[id(t.fake_mode)] = t.fake_mode
        return t

    for value in values:
        try:
            _walk(value, visit, {}, set())
        except (_Unsafe, RecursionError):  # values never evaluated; too deep to walk
            pass
    return list(found.values())


#: graph -> the fake mode its real tensors are converted in (one per graph, so one real
#: tensor is one fake tensor across rewrites)
_FRESH_MODES: weakref.WeakKeyDictionary[fx.Graph, FakeTensorMode] = weakref.WeakKeyDictionary()
#: serializes evaluation (a mode's settings are changed while it runs) and the fill of
#: ``_FRESH_MODES``
_LOCK = threading.RLock()


def _mode_for(graph: fx.Graph, values: list[Any]) -> FakeTensorMode | None:
    """The mode to evaluate in: the inputs' fake mode, or the graph's fresh one when they
    carry real tensors only; None for two modes or a mode with Python of its own."""
    modes = _modes(values)
    if len(modes) > 1:  # fake tensors of two modes cannot meet in one computation
        return None
    if modes:
        return modes[0] if type(modes[0]) is FakeTensorMode else None
    with _LOCK:  # one fresh mode per graph, also when two threads ask at once
        mode = _FRESH_MODES.get(graph)
        if mode is None:
            mode = _FRESH_MODES[graph] = FakeTensorMode(allow_fallback_kernels=False)
    return mode


class _Values:
    """The fake values an op runs on: the inputs' own (a real tensor converted once per
    mode), or for an op that writes in place, fresh fake copies of them; and the guard
    they run under."""

    def __init__(self, mode: FakeTensorMode, guard: _TorchCodeOnly):
        self.mode, self.guard = mode, guard
        self.own: dict[int, Any] = {}
        self.copies: dict[int, Any] = {}

    def __call__(self, value: Any, copy: bool = False) -> Any:
        if copy:
            return _walk(self(value), self._copy, self.copies, set())
        return _walk(value, self._fake, self.own, set())

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is FakeTensor:
            if t.fake_mode is not self.mode:
                raise _Unsafe("fake tensors of two modes")
            return t
        if t.is_quantized or t.layout is not torch.strided or t.is_nested:
            raise _Unsafe("unsupported tensor")
        return self.mode.from_tensor(t, static_shapes=True)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def _torch_kernels(op: torch._ops.OpOverload) -> bool:
    """Whether every active kernel of ``op`` is compiled or registered by torch's own Python
    (meta registrations, refs): a kernel registered through ``torch.library`` from anyone
    else's code (``lib.impl("neg", f, "Meta")``) is recorded as registered there."""
    for line in torch._C._dispatch_dump(op.name()).splitlines():
        found = _ACTIVE_KERNEL.match(line)
        if found is None:
            continue
        source = os.path.normpath(found.group(1))
        if source.endswith(".py") and (not source.startswith(_TORCH_DIR) or source.startswith(_TORCH_REGISTRARS)):
            return False
    return True


def _torch_owned(op: torch._ops.OpOverload) -> bool:
    """Whether running ``op`` under a fake mode runs torch's (or fxopt's) code only."""
    if op.namespace in (_OWN_NAMESPACE, "prim"):  # fxopt's ops; TorchScript's builtins (C++)
        return True
    if any(tag in op.tags for tag in _DATA_DEPENDENT):
        return False
    if op.namespace == "prims":  # torch's prims carry their meta function as a fake kernel
        return getattr(torch._prims, op._opname, None) is op.overloadpacket.default
    if op.namespace != "aten" or getattr(op, "_defined_in_python", False):
        return False
    schema = op._schema
    registered = getattr(_python_kernels, "get", None) or _python_kernels.find  # no get: older torch
    for qualname in (schema.name, f"{schema.name}.{schema.overload_name}"):
        entry = registered(qualname)
        if entry is not None and (entry.fake_impl.kernel is not None
                                  or entry.torch_dispatch_rules.find(FakeTensorMode) is not None):
            return False
    return _torch_kernels(op)


class _TorchCodeOnly(TorchDispatchMode):
    """Refuses, as it is dispatched, any op whose fake run would execute someone else's
    Python (see :func:`_torch_owned`). Registrations cannot change while it is active
    (only torch's code runs), so each op's verdict is worked out once."""

    def __init__(self) -> None:
        super().__init__()
        self.verdicts: dict[torch._ops.OpOverload, bool] = {}

    def owned(self, op: torch._ops.OpOverload) -> bool:
        verdict = self.verdicts.get(op)
        if verdict is None:
            verdict = self.verdicts[op] = _torch_owned(op)
        return verdict

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self.owned(func):
            raise _Unsafe(f"{func} would run code torch does not own")
        return func(*args, **(kwargs or {}))


@contextmanager
def _evaluating(mode: FakeTensorMode) -> Iterator[_TorchCodeOnly]:
    """Run ops for their fake values only: the user's dispatch modes off, no fallback to
    real kernels, no new guards, every dispatched op checked; the mode's settings restored."""
    shape_env = mode.shape_env
    with _LOCK, fake_mode_lock(mode), ExitStack() as stack:
        stack.enter_context(_disable_current_modes())
        fallback = mode.allow_fallback_kernels
        mode.allow_fallback_kernels = False
        stack.callback(setattr, mode, "allow_fallback_kernels", fallback)
        if shape_env is not None:
            stack.enter_context(shape_env.error_on_new_guards() if hasattr(shape_env, "error_on_new_guards")
                                else _frozen(shape_env))
        stack.enter_context(torch.no_grad())
        stack.enter_context(mode)
        yield stack.enter_context(_TorchCodeOnly())


@contextmanager
def _frozen(shape_env: Any) -> Iterator[None]:
    """``ShapeEnv.error_on_new_guards`` for torch versions without it (2.11): there a frozen
    environment only logs a guard it ignores, so ``_check_frozen`` (which every guard passes
    through, on all supported versions) is made to raise on this instance: the op then gets
    no value, instead of one that holds only under an unrecorded guard."""
    def refuse(expr: Any, concrete_val: Any = None) -> None:
        raise _Unsafe(f"a new guard {expr} == {concrete_val}")

    saved = shape_env.frozen
    shape_env.frozen = True
    shape_env._check_frozen = refuse
    try:
        yield
    finally:
        shape_env.frozen = saved
        del shape_env._check_frozen


def _torch_method(name: Any) -> bool:
    """A public ``Tensor`` method implemented by torch (not one patched onto the class)."""
    if type(name) is not str or name.startswith("_"):
        return False
    method = getattr(torch.Tensor, name, None)
    if isinstance(method, _C_METHODS):
        return True
    return isinstance(method, types.FunctionType) and method.__module__.startswith("torch.")


def _safe_target(node: fx.Node, guard: _TorchCodeOnly) -> bool:
    target = node.target
    if node.op == "call_method":
        return _torch_method(target)
    if node.op != "call_function":
        return False
    kind = type(target)
    if kind is torch._ops.OpOverload:
        return guard.owned(target)
    if kind is torch._ops.OpOverloadPacket:  # the overload that runs is checked when dispatched
        return target._qualified_op_name.split("::")[0] in ("aten", "prims", _OWN_NAMESPACE)
    if kind is types.BuiltinFunctionType and getattr(operator, getattr(target, "__name__", ""), None) is target:
        return True
    return torch_name(target) is not None


_SKIP = object()
_NUMBERS = _ids(int, float, bool)  # attributes that are their own value (a constant a replacement reads)


def _evaluate(gm: fx.GraphModule, node: fx.Node, values: _Values, invalid: set[fx.Node]) -> Any:
    if node.op == "get_attr":
        value = lookup_attr(gm, node.target)
        if id(type(value)) in _TENSORS:
            return values(value)
        return value if id(type(value)) in _NUMBERS else _SKIP
    if not _safe_target(node, values.guard) or any(i in invalid or "val" not in i.meta for i in node.all_input_nodes):
        return _SKIP
    writes = bool(mutated_inputs(node))
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: values(n.meta["val"], copy=writes))
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
    inputs = [i.meta.get("val") for n in created for i in n.all_input_nodes if i not in mine]
    device = gm.meta.get(META_VALUES_DEVICE)
    if device is not None and not _modes(inputs):  # meta values (a stale mark under fake values: ignored)
        _propagate_by_rules(gm, created, Env(device))
        return
    mode = _mode_for(gm.graph, inputs)
    invalid: set[fx.Node] = set()
    with _evaluating(mode) if mode is not None else nullcontext() as guard:
        values = None if mode is None else _Values(mode, guard)
        for node in created:
            value = _SKIP
            if values is not None:
                try:
                    value = _evaluate(gm, node, values, invalid)
                    _walk(value, lambda t: t, {}, set())  # a result we can store
                except Exception:  # an op fake tensors cannot run (data-dependent, bad inputs, refused)
                    value = _SKIP
            if value is not _SKIP:
                record_value(node, value)
            elif node.op in ("call_module", "get_attr") or "val" not in node.meta or \
                    any(i in invalid for i in node.all_input_nodes) or values is None:
                invalid.add(node)
                node.meta.pop("val", None)
                node.meta.pop("tensor_meta", None)


def _propagate_by_rules(gm: fx.GraphModule, created: list[fx.Node], env: Env) -> None:
    """:func:`propagate_meta` for a graph of meta values: fxopt's shape rules."""
    invalid: set[fx.Node] = set()
    for node in created:
        value = _SKIP
        if not any(i in invalid or "val" not in i.meta for i in node.all_input_nodes):
            try:
                with torch.no_grad():
                    value = _by_rule(gm, node, env)
            except NoRule:
                value = _SKIP
        if value is not _SKIP:
            record_value(node, value)
        elif type(node.meta.get("val")) is not torch.Tensor or not node.meta["val"].is_meta or \
                node.op in ("call_module", "get_attr") or any(i in invalid for i in node.all_input_nodes):
            invalid.add(node)  # only an annotated meta value of unchanged inputs is kept
            node.meta.pop("val", None)
            node.meta.pop("tensor_meta", None)


def _by_rule(gm: fx.GraphModule, node: fx.Node, env: Env) -> Any:
    if node.op == "get_attr":
        value = lookup_attr(gm, node.target)
        return value if id(type(value)) in _NUMBERS else meta_copy(env, value)
    if not has_rule(gm, node):
        raise NoRule(f"no rule for {node.target}")
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    return evaluate(gm, node, args, kwargs, env)
