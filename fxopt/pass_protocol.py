"""The pass protocol: what a pass is, what it declares, and how plain functions fit in.

A pass is a small object with a ``name``, declared ``options``, the analyses it
``requires`` and ``preserves``, and ``run(gm, ctx) -> PassResult``. Declaring options
as :class:`Option` objects (rather than free ``**kwargs``) is what lets the textual
pipeline ``"quantize{mode=int8_weight_only}"`` be parsed *and validated* before any
pass runs, and lets ``fxopt passes`` document every option.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch.fx as fx

from fxopt.errors import NotAPassError, PassContractError, PassOptionError

if TYPE_CHECKING:
    from fxopt.context import PassContext


@dataclass(frozen=True)
class Option:
    """A declared pass option: its type, default, allowed values and a one-line doc."""

    type: type
    default: Any
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    #: the smallest value allowed (numeric options)
    minimum: float | None = None

    def coerce(self, pass_name: str, key: str, value: Any) -> Any:
        """Return ``value`` converted to this option's type, or raise PassOptionError.

        Strings are converted (they come from textual pipelines and the command line);
        other values must already have the right type (bool is not accepted as int).
        """
        if isinstance(value, str) and self.type is not str:
            value = _parse_scalar(pass_name, key, value, self.type)
        elif self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.type) or (self.type is int and isinstance(value, bool)):
            raise PassOptionError(
                pass_name, key, f"expected {self.type.__name__}, got {type(value).__name__} {value!r}"
            )
        if self.choices is not None and value not in self.choices:
            raise PassOptionError(pass_name, key, f"{value!r} is not one of {list(self.choices)}")
        if self.minimum is not None and value < self.minimum:
            raise PassOptionError(pass_name, key, f"must be at least {self.minimum}, got {value!r}")
        return value


def _parse_scalar(pass_name: str, key: str, text: str, typ: type) -> Any:
    if typ is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise PassOptionError(pass_name, key, f"expected a bool, got {text!r}")
    try:
        return typ(text)
    except (TypeError, ValueError):
        raise PassOptionError(pass_name, key, f"expected {typ.__name__}, got {text!r}") from None


@dataclass
class PassResult:
    """What a pass reports: whether it changed the graph, plus free-form statistics."""

    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)


class Pass:
    """Base class of fxopt passes.

    Subclasses set the class attributes and implement :meth:`run`. ``run`` mutates ``gm``
    in place (graph, modules, attributes) and returns a :class:`PassResult` (a bare bool
    is accepted). It must not mutate the *data* of existing parameters or buffers: it
    creates new tensors instead, which is what makes the PassManager's rollback cheap and
    exact. A pass need not call ``gm.recompile()``; the manager does that once per change.
    """

    name: ClassVar[str] = ""
    #: declared options; instances receive validated values in ``self.options``
    options: ClassVar[Mapping[str, Option]] = {}
    #: analyses computed (and cached) before ``run`` is called: see fxopt.analysis
    requires: ClassVar[tuple[str, ...]] = ()
    #: analyses that stay valid after this pass changed the graph; "*" means all
    preserves: ClassVar[tuple[str, ...]] = ()
    #: passes that must come *earlier* in a pipeline whenever both are present
    after: ClassVar[tuple[str, ...]] = ()
    #: passes that must come *later* in a pipeline whenever both are present
    before: ClassVar[tuple[str, ...]] = ()
    #: only sound when the model runs in inference (no autograd, eval mode)
    inference_only: ClassVar[bool] = False
    #: whether the pass needs ``meta['val']`` to be FakeTensors (their fake mode, their real
    #: devices). A pass that reads only shapes, dtypes, strides and which values share a
    #: storage says False; a run made only of such passes may give the graph meta values
    #: by fxopt's own shape rules, which spares the first run of a process the import of
    #: ``torch._dynamo`` (see :mod:`fxopt.analysis.shapes`)
    needs_fake_values: ClassVar[bool] = True

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(self.options) or "none"
            raise PassOptionError(self.name, unknown[0], f"unknown option (known options: {known})")
        self.options: dict[str, Any] = {
            key: opt.coerce(self.name, key, options[key]) if key in options else opt.default
            for key, opt in type(self).options.items()
        }

    @classmethod
    def description(cls) -> str:
        """The docstring's first paragraph on one line: what ``fxopt passes`` prints."""
        paragraph = (inspect.getdoc(cls) or "").strip().split("\n\n")[0]
        return " ".join(paragraph.split())

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult | bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.options.items() if v != type(self).options[k].default}
        opts = "{" + ",".join(f"{k}={v}" for k, v in changed.items()) + "}" if changed else ""
        return f"{self.name}{opts}"


class FunctionPass(Pass):
    """Wraps a plain ``fn(gm) -> GraphModule | None`` so it can sit in a pipeline.

    A function that returns ``None`` is taken to have mutated ``gm`` in place; one that
    returns a *different* GraphModule has its graph and attributes adopted into ``gm``,
    so the caller's object stays the one that is optimized. Change is detected by
    comparing the graph's structure before and after, since a function cannot say.
    """

    def __init__(self, fn: Callable[[fx.GraphModule], fx.GraphModule | None], name: str | None = None):
        super().__init__()
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        before = graph_fingerprint(gm.graph)
        out = self.fn(gm)
        if out is not None and out is not gm:
            if not isinstance(out, fx.GraphModule):
                raise PassContractError(
                    self.name, f"returned {type(out).__name__}; a pass returns a GraphModule or None"
                )
            adopt(gm, out)
        return PassResult(changed=graph_fingerprint(gm.graph) != before)


def graph_fingerprint(graph: fx.Graph) -> tuple:
    """A cheap structural identity of a graph, used to detect whether it changed."""
    return tuple((n.name, n.op, n.target, n.args, tuple(n.kwargs.items())) for n in graph.nodes)


def adopt(gm: fx.GraphModule, other: fx.GraphModule) -> None:
    """Make ``gm`` compute what ``other`` computes: take its graph, submodules and attributes."""
    for name, mod in other.named_children():
        setattr(gm, name, mod)
    for name, value in vars(other).items():
        if name.startswith("_") or name in ("training", "meta"):
            continue
        setattr(gm, name, value)
    for name, buf in other.named_buffers(recurse=False):
        gm.register_buffer(name, buf)
    for name, param in other.named_parameters(recurse=False):
        gm.register_parameter(name, param)
    gm.graph = other.graph


def as_pass(item: Pass | Callable[[fx.GraphModule], Any]) -> Pass:
    """Coerce a pass object or a plain callable into a :class:`Pass`."""
    if isinstance(item, Pass):
        return item
    if isinstance(item, type) and issubclass(item, Pass):
        return item()
    if callable(item):
        return FunctionPass(item)
    raise NotAPassError(f"not a pass: {item!r} ({type(item).__name__})")
