"""Turning a pattern and its replacement into graphs, once, with early errors.

A pattern is a plain function (or an ``nn.Module``, a ``GraphModule`` or an ``fx.Graph``,
as ``torch.fx.replace_pattern`` accepts): its parameters are the holes (a hole binds to
a node, a module parameter or a literal, and a hole in a literal position *captures* the
literal for the replacement); literals written in its body must match exactly, and
:data:`ANY` matches any literal without capturing it. A parameter-free module called in
a pattern (``nn.Sigmoid()``, ``nn.GELU("tanh")``) matches by type and attributes; a
``get_attr`` in a pattern (a tensor attribute of a pattern module) matches any
``get_attr``. Both are traced with ``torch.fx`` when the rule is created; everything that
can be wrong with them is reported then, with the function's name, rather than as a
silent non-match later. Tracing patches nothing process-wide (:mod:`fxopt.patterns.tracing`):
rules may be created in several threads at once, while other threads run models.

A pattern may return several values. Matching starts at one output that no other output
depends on (the *anchor*); every other output must be computed from the anchor's part or
directly from an input the rest of the pattern uses (``sigmoid(a), relu(a)``), so that it
is found among that value's users.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.nn as nn
from fxopt.patterns.canon import Canon, canonicalize
from fxopt.patterns.tracing import ANY, PatternTracer

from fxopt.analysis.ops import keeps_input_metadata, mutated_inputs, output_aliases
from fxopt.errors import PatternError
from fxopt.graph_utils import upstream

#: what a pattern or a replacement may be given as
PatternSource = Callable[..., Any] | nn.Module | fx.Graph


def describe(fn: Any) -> str:
    """``name(args)`` of a pattern or replacement, for error messages."""
    if isinstance(fn, fx.Graph):
        holes = [n.target for n in fn.nodes if n.op == "placeholder"]
        return f"graph({', '.join(holes)})"
    if isinstance(fn, nn.Module):
        fn = fn.forward
    try:
        return f"{getattr(fn, '__name__', 'fn')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def trace_function(fn: PatternSource, role: str) -> tuple[fx.Graph, nn.Module | None]:
    """``fn`` as a graph, and the module that owns its attributes (None for a function),
    or say why it cannot be traced. A replacement *module* keeps its submodule calls (they
    are copied into the rewritten module); a pattern module's submodules trace as calls."""
    if isinstance(fn, fx.GraphModule):
        return fn.graph, fn
    if isinstance(fn, fx.Graph):
        return fn, fn.owning_module
    if not callable(fn):
        raise PatternError(f"the {role} must be a function, an nn.Module or an fx.Graph, "
                           f"got {type(fn).__name__}")
    try:
        graph = PatternTracer(role).trace(fn)
        return graph, fn if isinstance(fn, nn.Module) else None
    except PatternError:
        raise
    except Exception as exc:
        raise PatternError(
            f"cannot trace {role} {describe(fn)}: {type(exc).__name__}: {exc}. Patterns and "
            "replacements are traced once with their arguments symbolic: no "
            "Python control flow on arguments, no data-dependent shapes"
        ) from exc


def _returned(graph: fx.Graph) -> list[Any]:
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    return list(returned) if isinstance(returned, (tuple, list)) else [returned]


def _without_literals(value: Any) -> Any:
    """``value`` with every literal replaced by :data:`ANY` (``ignore_literals``)."""
    if isinstance(value, fx.Node):
        return value
    if isinstance(value, (list, tuple)) and any(isinstance(v, fx.Node) for v in value):
        return type(value)(_without_literals(v) for v in value)
    return ANY


@dataclass
class CompiledPattern:
    """A traced pattern: holes, body nodes with their canonical forms, outputs."""

    fn: PatternSource
    graph: fx.Graph
    holes: list[fx.Node]
    outputs: list[fx.Node]
    canon: dict[fx.Node, Canon]
    #: the output matching starts from (no other output depends on it)
    anchor: fx.Node
    #: the other outputs outside the anchor's inputs, each with an already matched input
    #: among whose users it is searched
    extras: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)
    #: arguments the pattern itself writes in place (``copy_(t, ...)``)
    writes: frozenset[str] = frozenset()
    #: interior node -> an output with its shape, dtype and device (``conv`` -> the
    #: ``batch_norm`` of it): metadata reads of the interior node may use the output
    meta_twins: dict[fx.Node, fx.Node] = field(default_factory=dict)
    #: op nodes that are not outputs: the rewrite removes them, so they may have no users
    #: outside the match (worked out once, read by every match's checks)
    interior: tuple[fx.Node, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.interior = tuple(p for p in self.canon if p not in self.outputs)

    @property
    def signature(self) -> str:
        return describe(self.fn)

    def __len__(self) -> int:
        return len(self.canon)


def compile_pattern(fn: PatternSource, *, ignore_literals: bool = False) -> CompiledPattern:
    graph, _ = trace_function(fn, "pattern")
    name = describe(fn)
    holes = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = _returned(graph)
    unused = [h.target for h in holes if not h.users]
    if unused:
        raise PatternError(f"pattern {name}: argument(s) {', '.join(unused)} are never used; "
                           "a pattern's every argument must take part in what it returns")
    for out in outputs:
        if not isinstance(out, fx.Node) or out.op in ("placeholder", "get_attr"):
            raise PatternError(f"pattern {name} must return computed values, not {out!r}")
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    dead = [n.name for n in body if not n.users]
    if dead:
        raise PatternError(f"pattern {name}: dead code ({', '.join(dead)}) does not contribute "
                           "to the result; remove it or return it")
    canon: dict[fx.Node, Canon] = {}
    for node in body:
        if node.op == "get_attr":
            continue
        form = canonicalize(node)
        if form is None:
            raise PatternError(f"pattern {name}: cannot interpret node {node.format_node()}")
        if ignore_literals:
            form = Canon(form.op, tuple(_without_literals(a) for a in form.args), form.inplace)
        canon[node] = form
    anchor, extras = _anchor_and_extras(outputs, name)
    writes = _written_holes(body, {h: h.target for h in holes})
    return CompiledPattern(fn, graph, holes, outputs, canon, anchor, extras, writes,
                           _meta_twins(outputs, canon))


def _meta_twins(outputs: list[fx.Node], canon: dict[fx.Node, Canon]) -> dict[fx.Node, fx.Node]:
    """Interior nodes whose value an output reproduces in shape, dtype and device: down
    a chain of ops that keep their first argument's metadata (op facts)."""
    twins: dict[fx.Node, fx.Node] = {}
    for out in outputs:
        node = out
        while node in canon and keeps_input_metadata(canon[node].op) and canon[node].args:
            source = canon[node].args[0]
            if not isinstance(source, fx.Node) or source not in canon or source in outputs:
                break
            twins.setdefault(source, out)
            node = source
    return twins


def _anchor_and_extras(outputs: list[fx.Node], name: str) -> tuple[fx.Node, list[tuple[fx.Node, fx.Node]]]:
    """The anchor (the last output no other output depends on) and, for every output
    outside its inputs, an input of that output which is matched before it."""
    feeding = upstream(outputs)
    anchor = next(o for o in reversed(outputs) if o not in feeding)
    covered = upstream([anchor]) | {anchor}
    extras = []
    for out in dict.fromkeys(reversed(outputs)):
        if out in covered:
            continue
        known = next((i for i in out.all_input_nodes if i in covered), None)
        if known is None:
            raise PatternError(
                f"pattern {name}: output {out.name!r} shares no direct input with the rest of "
                "the pattern; fxopt finds an extra output among the users of a value the "
                "pattern already matched")
        extras.append((out, known))
        covered |= upstream([out]) | {out}
    return anchor, extras


@dataclass
class CompiledReplacement:
    """A traced replacement, split for inlining: holes (with the pattern argument each
    stands for), body in order, returned value, and the module owning its attributes."""

    fn: PatternSource
    graph: fx.Graph
    holes: list[fx.Node]
    body: list[fx.Node]
    output: Any
    #: replacement placeholder -> the pattern argument (hole name) it receives
    binding: dict[fx.Node, str]
    root: nn.Module | None = None
    #: pattern arguments whose tensors the replacement writes in place (through views too)
    writes: frozenset[str] = frozenset()
    #: the returned values as a list, one per pattern output (read by every rewrite)
    returned: list[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.returned = list(self.output) if isinstance(self.output, (tuple, list)) else [self.output]


def compile_replacement(fn: PatternSource, pattern: CompiledPattern, *,
                        positional: bool = False) -> CompiledReplacement:
    """Trace the replacement and check that it fits the pattern: its parameters are named
    after pattern arguments (a subset, any order), or with ``positional`` (torch.fx's
    rule) correspond one to one in order; it returns as many values as the pattern."""
    graph, root = trace_function(fn, "replacement")
    holes = [n for n in graph.nodes if n.op == "placeholder"]
    hole_names = [h.target for h in pattern.holes]
    n_outputs = len(_returned(graph))
    if positional:
        binding = dict(zip(holes, hole_names))
        why = (f"it takes {len(holes)} argument(s), the pattern {len(hole_names)} (torch.fx "
               "pairs them by position)") if len(holes) != len(hole_names) else ""
    else:
        binding = {h: h.target for h in holes}
        unknown = [h.target for h in holes if h.target not in hole_names]
        why = f"parameter(s) {', '.join(unknown)} are not pattern arguments" if unknown else ""
    if not why and n_outputs != len(pattern.outputs):
        why = f"it returns {n_outputs} value(s), the pattern {len(pattern.outputs)}"
    if why:
        raise PatternError(f"replacement {describe(fn)} does not fit pattern {pattern.signature}: {why}")
    # torch.fx's rule (positional): an attribute may come from the rewritten module instead
    missing = [] if positional else [n.target for n in graph.nodes if n.op in ("get_attr", "call_module")
                                     and (root is None or lookup_attr(root, n.target) is None)]
    if missing:
        raise PatternError(f"replacement {describe(fn)} uses attribute(s) {', '.join(missing)} "
                           "that its module does not have")
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    return CompiledReplacement(fn, graph, holes, body, returned, binding, root,
                               _written_holes(body, binding))


def per_match(callback: Callable[[Any], PatternSource], pattern: CompiledPattern, *,
              positional: bool = False) -> Callable[[Any], CompiledReplacement]:
    """A replacement chosen per match: ``callback(match)`` returns a function, module or
    graph, compiled (and checked against the pattern) like a fixed replacement. The last
    one compiled is reused while the callback keeps returning it, so a callback that picks
    among a few replacements traces each at most once in a row. The (source, compiled) pair
    is read and replaced as one object: a rule applied in several threads at once never
    returns another thread's replacement."""
    last: list[tuple[Any, CompiledReplacement | None]] = [(None, None)]

    def replacement_for(m: Any) -> CompiledReplacement:
        source = callback(m)
        cached, compiled = last[0]
        if cached is not source or compiled is None:
            compiled = compile_replacement(source, pattern, positional=positional)
            last[0] = (source, compiled)
        return compiled

    return replacement_for


def _written_holes(body: list[fx.Node], binding: dict[fx.Node, str]) -> frozenset[str]:
    """Pattern arguments the replacement writes into: a write reaches every input its
    target may alias (op facts; an unknown op may alias all of its inputs)."""
    written: set[str] = set()
    stack = [w for n in body for w in mutated_inputs(n)]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            written.add(binding[node])
        elif node.op != "get_attr":
            stack.extend(output_aliases(node))
    return frozenset(written)


_NOT_FOUND = object()


def lookup_attr(root: nn.Module, target: str) -> Any:
    """The attribute ``target`` of ``root`` (a submodule, parameter, buffer or plain
    attribute) without running any descriptor; None when there is none."""
    *path, attr = target.split(".")
    module = root
    for part in path:
        module = module.__dict__.get("_modules", {}).get(part)
        if module is None:
            return None
    for table in ("_modules", "_parameters", "_buffers"):
        value = module.__dict__.get(table, {}).get(attr, _NOT_FOUND)
        if value is not _NOT_FOUND:
            return value
    return module.__dict__.get(attr)
