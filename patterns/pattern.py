"""Turning a pattern function and its replacement into graphs, once, with early errors.

A pattern is a plain function: its parameters are the holes (a hole binds to a node, a
module parameter or a literal, and a hole in a literal position *captures* the literal
for the replacement); literals written in its body must match exactly, and
:data:`ANY` matches any literal without capturing it. Both functions are traced with
``torch.fx`` when the rule is created; everything that can be wrong with them is
reported then, with the function's name, rather than as a silent non-match later.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn as nn
from fxopt.patterns.canon import CalledModule, Canon, canonicalize

from fxopt.analysis.ops import mutated_inputs, output_aliases
from fxopt.errors import PatternError
from fxopt.graph_utils import upstream


class _Any:
    """Matches any literal argument (not captured). ``fxopt.patterns.ANY``."""

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()


class _PatternTracer(fx.Tracer):
    """Traces parameter-free modules used inside a pattern (``nn.ReLU()(x)``) as calls of
    the module object, so they canonicalize like the installed modules they stand for."""

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
            raise PatternError(
                f"{type(m).__name__} has parameters or buffers; in a pattern, write the "
                "functional form (F.conv2d(x, w, b, ...)) with the tensors as pattern arguments"
            )
        return self.create_proxy("call_function", CalledModule(m), args, kwargs)

    def create_arg(self, a: Any) -> Any:
        return a if a is ANY else super().create_arg(a)


def _signature(fn: Callable) -> str:
    try:
        return f"{getattr(fn, '__name__', 'fn')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def trace_function(fn: Callable, role: str) -> fx.Graph:
    """Trace ``fn`` into a graph, or say why it cannot be traced."""
    if not callable(fn):
        raise PatternError(f"the {role} must be a function, got {type(fn).__name__}")
    try:
        return _PatternTracer().trace(fn)
    except PatternError:
        raise
    except Exception as exc:
        raise PatternError(
            f"cannot trace {role} {_signature(fn)}: {type(exc).__name__}: {exc}. Patterns and "
            "replacements are traced once with torch.fx with their arguments symbolic: no "
            "Python control flow on arguments, no data-dependent shapes"
        ) from exc


@dataclass
class CompiledPattern:
    """A traced pattern: holes, body nodes with their canonical forms, outputs."""

    fn: Callable
    graph: fx.Graph
    holes: list[fx.Node]
    outputs: list[fx.Node]
    canon: dict[fx.Node, Canon]

    @property
    def anchor(self) -> fx.Node:
        """The output matching starts from: the last one (the others are its ancestors)."""
        return self.outputs[-1]

    @property
    def signature(self) -> str:
        return _signature(self.fn)

    def __len__(self) -> int:
        return len(self.canon)


def compile_pattern(fn: Callable) -> CompiledPattern:
    graph = trace_function(fn, "pattern")
    name = _signature(fn)
    holes = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    returned = output.args[0]
    outputs = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    unused = [h.target for h in holes if not h.users]
    if unused:
        raise PatternError(f"pattern {name}: argument(s) {', '.join(unused)} are never used; "
                           "a pattern's every argument must take part in what it returns")
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    dead = [n.name for n in body if not n.users]
    if dead:
        raise PatternError(f"pattern {name}: dead code ({', '.join(dead)}) does not contribute "
                           "to the result; remove it or return it")
    for out in outputs:
        if not isinstance(out, fx.Node) or out.op == "placeholder":
            raise PatternError(f"pattern {name} must return computed values, not {out!r}")
    canon: dict[fx.Node, Canon] = {}
    for node in body:
        if node.op == "get_attr":
            raise PatternError(f"pattern {name} reads attribute {node.target!r}; pass tensors as arguments")
        form = canonicalize(node)
        if form is None:
            raise PatternError(f"pattern {name}: cannot interpret node {node.format_node()}")
        canon[node] = form
    anchor_ancestors = upstream([outputs[-1]])
    stray = [o.name for o in outputs[:-1] if o not in anchor_ancestors]
    if stray:
        raise PatternError(f"pattern {name}: output(s) {', '.join(stray)} must feed the last output "
                           "(multi-output patterns are matched from their last output)")
    outside = [n.name for n in body if n not in anchor_ancestors and n is not outputs[-1]]
    if outside:
        raise PatternError(f"pattern {name}: node(s) {', '.join(outside)} do not feed the last output")
    return CompiledPattern(fn, graph, holes, outputs, canon)




@dataclass
class CompiledReplacement:
    """A traced replacement, split for inlining: holes, body in order, returned value."""

    fn: Callable
    graph: fx.Graph
    holes: list[fx.Node]
    body: list[fx.Node]
    output: Any


def compile_replacement(fn: Callable, pattern: CompiledPattern) -> CompiledReplacement:
    """Trace the replacement and check that it fits the pattern: its parameters are named
    after pattern arguments (a subset, any order) and it returns as many values."""
    graph = trace_function(fn, "replacement")
    params = [n.target for n in graph.nodes if n.op == "placeholder"]
    hole_names = [h.target for h in pattern.holes]
    unknown = [p for p in params if p not in hole_names]
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    n_outputs = len(returned) if isinstance(returned, (tuple, list)) else 1
    if unknown or n_outputs != len(pattern.outputs):
        why = (f"parameter(s) {', '.join(unknown)} are not pattern arguments" if unknown else
               f"it returns {n_outputs} value(s), the pattern {len(pattern.outputs)}")
        raise PatternError(f"replacement {_signature(fn)} does not fit pattern {pattern.signature}: {why}")
    if any(n.op == "get_attr" for n in graph.nodes):
        raise PatternError(f"replacement {_signature(fn)} reads module attributes; pass tensors as arguments")
    holes = [n for n in graph.nodes if n.op == "placeholder"]
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    _check_writes_only_its_own(fn, holes, body)
    return CompiledReplacement(fn, graph, holes, body, returned)


def _check_writes_only_its_own(fn: Callable, holes: list[fx.Node], body: list[fx.Node]) -> None:
    """A replacement's arguments are the caller's tensors (graph inputs, parameters, values
    used after the match): writing one in place, or a view of one, changes the program."""
    callers = set(holes)  # the arguments and every value that may share their storage
    for node in body:
        written = [w for w in mutated_inputs(node) if w in callers]
        if written:
            raise PatternError(
                f"replacement {_signature(fn)} writes in place into {written[0].name!r} (at "
                f"{node.name!r}), which is the caller's tensor or a view of one: the write would "
                "be visible outside the match; write only into tensors the replacement creates")
        if callers.intersection(output_aliases(node)):
            callers.add(node)
