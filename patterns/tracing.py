"""Tracing a pattern or a replacement into a graph without patching anything process-wide.

``torch.fx.Tracer.trace`` patches ``nn.Module.__call__`` and ``__getattr__``, and the
globals of every module that registered a function with ``torch.fx.wrap``, *for the whole
process* while it runs: a model called in another thread meanwhile goes through the
tracer, and two concurrent traces put each other's patches back in the wrong order. Patterns
and replacements are functions of tensors and parameter-free modules, so they need none of
that; :class:`PatternTracer` runs the function on :class:`torch.fx.Proxy` arguments of a
tracer of its own and touches nothing another thread can see:

- torch functions, ``Tensor`` methods, operators and ``torch.ops`` overloads record
  themselves (``Proxy`` implements ``__torch_function__`` and the magic methods);
- a function registered with ``torch.fx.wrap`` stays one call: the traced function (and
  the functions of its own module it calls) run with a private copy of the module's
  globals in which each wrapped name records a call; the module itself is not touched;
- a pattern or replacement given as an ``nn.Module`` runs its ``forward`` on a stand-in of
  the module: parameters and buffers read as ``get_attr`` nodes, submodule calls go to
  :meth:`PatternTracer.call_module` (a pattern's become calls of the module object, a
  replacement's are kept as ``call_module`` the way ``torch.fx.symbolic_trace`` keeps them);
- a module called inside the body (``nn.ReLU()(x)``) runs its ``forward`` on the proxies,
  which records its functional form: the same canonical op as the module
  (:mod:`fxopt.patterns.canon`). A module with parameters or buffers is refused as soon
  as its ``forward`` records anything, with the error a pattern with parameters gets.
"""

from __future__ import annotations

import builtins
import collections
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from fxopt.patterns.canon import CalledModule
from torch.fx import _symbolic_trace

from fxopt.errors import PatternError


class _Any:
    """Matches any literal argument (not captured). ``fxopt.patterns.ANY``."""

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()

#: the code of torch.fx's recording wrapper, which ``symbolic_trace`` (of a user's model, in
#: another thread) puts in place of a wrapped function in its module's globals while it runs
_TORCH_WRAPPER_CODE = _symbolic_trace._create_wrapped_func(len).__code__
#: the frames of a module call (``m(x)``): their ``self`` is the module being called
_MODULE_CALL_CODES = frozenset(getattr(nn.Module, name).__code__ for name in ("_wrapped_call_impl", "_call_impl")
                               if hasattr(nn.Module, name))


def has_state(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) holds parameters or buffers."""
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def _stateful_module_error(module: nn.Module) -> PatternError:
    return PatternError(
        f"{type(module).__name__} has parameters or buffers; in a pattern, write the "
        "functional form (F.conv2d(x, w, b, ...)) with the tensors as pattern arguments")


class PatternTracer(fx.Tracer):
    """Traces a pattern (``role="pattern"``) or a replacement (``role="replacement"``):
    ``trace(fn)`` runs ``fn`` on proxies and returns its graph; see the module docstring.
    One instance traces one function, in the calling thread only."""

    def __init__(self, role: str):
        super().__init__(autowrap_modules=(), autowrap_functions=())
        self.role = role
        # torch keeps this counter on the Tracer class, shared by every tracer of the process
        self._qualname_counter = collections.defaultdict(int)
        self._attr_proxies: dict[str, fx.Proxy] = {}
        self._entry: types.FrameType | None = None

    def trace(self, root: nn.Module | Callable[..., Any], concrete_args: None = None) -> fx.Graph:
        module = root if isinstance(root, nn.Module) else None
        fn = type(root).forward if module is not None else root
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"{type(fn).__name__} is not a Python function")
        self.root = module if module is not None else nn.Module()
        self.submodule_paths = {m: name for name, m in self.root.named_modules()}
        self.tensor_attrs = {value: name for name, value in _plain_tensors(self.root)}
        self.graph = fx.Graph(tracer_cls=type(self))
        fn, args = self.create_args_for_root(_with_leaves(fn, self), module is not None)
        if module is not None:
            args[0] = _StandIn(self, module, "")
        self._entry = sys._getframe()
        try:
            result = fn(*args)
        finally:
            self._entry = None
        self.create_node("output", "output", (self.create_arg(result),), {})
        return self.graph

    def create_proxy(self, kind: str, target: Any, args: tuple, kwargs: dict, *rest: Any, **options: Any) -> fx.Proxy:
        self._refuse_stateful_module_calls()
        return super().create_proxy(kind, target, args, kwargs, *rest, **options)

    def create_arg(self, a: Any) -> Any:
        return a if a is ANY else super().create_arg(a)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """A submodule of a traced module is called: a replacement keeps the call
        (``torch.fx``'s leaf rule); a pattern records a call of the module object, which
        canonicalizes like the installed modules it stands for."""
        if self.role == "replacement":
            return super().call_module(m, forward, args, kwargs)
        if has_state(m):
            raise _stateful_module_error(m)
        return self.create_proxy("call_function", CalledModule(m), args, kwargs)

    def module_attribute(self, module: nn.Module, qualified: str, name: str) -> Any:
        """``module.name`` from the module's tables (``qualified`` from the root), as the
        traced forward reads it: a parameter or buffer is a ``get_attr`` node (one per
        attribute), a submodule a stand-in that calls it through the tracer."""
        tables = module.__dict__
        for table in ("_parameters", "_buffers"):
            if name in tables.get(table, {}):
                if tables[table][name] is None:
                    return None
                if qualified not in self._attr_proxies:
                    self._attr_proxies[qualified] = self.create_proxy("get_attr", qualified, (), {})
                return self._attr_proxies[qualified]
        sub = tables.get("_modules", {}).get(name, _MISSING)
        if sub is _MISSING:
            raise AttributeError(f"'{type(module).__name__}' object has no attribute '{name}'")
        return sub if sub is None else _StandIn(self, sub, qualified)

    def _refuse_stateful_module_calls(self) -> None:
        """Raise if this node is being recorded inside the call of a module with parameters
        or buffers made by the traced function (the outermost such call is named). Only
        the frames below :meth:`trace`'s count: the placeholders are made before the traced
        function runs, and the caller's own frames (a model being compiled, which imported
        the stock patterns) are no pattern's."""
        if self._entry is None:
            return
        frame, found = sys._getframe(2), None
        while frame is not None and frame is not self._entry:
            if frame.f_code in _MODULE_CALL_CODES:
                module = frame.f_locals.get("self")
                if isinstance(module, nn.Module) and has_state(module):
                    found = module
            frame = frame.f_back
        if found is not None:
            raise _stateful_module_error(found)


_MISSING = object()


def _plain_tensors(root: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors kept as plain attributes (not parameters or buffers) of ``root`` and its
    submodules, by qualified name: the tracer reads them as ``get_attr``, as torch.fx does."""
    found = []
    for prefix, m in root.named_modules():
        for name, value in m.__dict__.items():
            if isinstance(value, torch.Tensor):
                found.append((f"{prefix}.{name}" if prefix else name, value))
    return found


class _StandIn:
    """``self`` for the ``forward`` of a traced module (and of its submodules): attribute
    reads and submodule calls go through the tracer instead of through ``nn.Module``'s own
    ``__getattr__`` and ``__call__``, which stay as they are."""

    def __init__(self, tracer: PatternTracer, module: nn.Module, path: str):
        object.__setattr__(self, "_fxopt_target", (tracer, module, path))

    def __getattr__(self, name: str) -> Any:
        tracer, module, path = object.__getattribute__(self, "_fxopt_target")
        # Python's order: data descriptors of the class, the instance dict, other class
        # attributes (methods bind to the stand-in, so they read through it too), then
        # nn.Module's tables
        static = inspect.getattr_static(type(module), name, _MISSING)
        if (static is _MISSING or not hasattr(type(static), "__set__")) and name in module.__dict__:
            return module.__dict__[name]
        if static is not _MISSING:
            return static.__get__(self, type(module)) if hasattr(type(static), "__get__") else static
        return tracer.module_attribute(module, f"{path}.{name}" if path else name, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise PatternError(f"the traced forward sets attribute {name!r}: patterns and replacements "
                           "may not change their module")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer, module, _ = object.__getattribute__(self, "_fxopt_target")
        return tracer.call_module(module, functools.partial(type(module).forward, self), args, kwargs)


def _holds_proxy(value: Any) -> bool:
    found = []
    fx.node.map_aggregate(value, lambda a: found.append(a) if isinstance(a, fx.Proxy) else None)
    return bool(found)


def _leaf(original: Callable[..., Any], tracer: PatternTracer) -> Callable[..., Any]:
    """``original`` recorded as one call when it gets a proxy (``torch.fx.wrap``'s rule)."""
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not _holds_proxy((args, kwargs)):
            return original(*args, **kwargs)
        proxy = tracer.create_proxy("call_function", original, args, kwargs)
        proxy.node.meta["is_wrapped"] = True
        return proxy

    return call


def _rebound(fn: types.FunctionType, namespace: dict[str, Any]) -> types.FunctionType:
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__annotations__ = fn.__annotations__
    return copy


def _with_leaves(fn: types.FunctionType, tracer: PatternTracer) -> types.FunctionType:
    """``fn`` running with a private copy of its module's globals in which the names
    registered there with ``torch.fx.wrap`` record calls (so do the module's other
    functions, which see the same copy); ``fn`` itself when its module registered none."""
    namespace = fn.__globals__
    registered = list(_symbolic_trace._wrapped_fns_to_patch.items())
    wrapped = {name for (_, name), owner in registered if owner is namespace}
    if not wrapped:
        return fn
    snapshot = dict(namespace)  # one atomic copy: other threads may be changing the module
    private = dict(snapshot)
    for name, value in snapshot.items():
        if type(value) is types.FunctionType and value.__globals__ is namespace:
            private[name] = _rebound(value, private)
    for name in wrapped:
        original = snapshot[name] if name in snapshot else getattr(builtins, name)
        if getattr(original, "__code__", None) is _TORCH_WRAPPER_CODE:
            original = original.__wrapped__  # mid-way through a symbolic_trace of another thread
        private[name] = _leaf(original, tracer)
    return _rebound(fn, private)
