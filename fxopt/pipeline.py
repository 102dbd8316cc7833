"""Composing passes: sequences, fixpoints, conditionals, and the textual pipeline syntax.

Text form, parsed and validated before anything runs::

    "cse,fold_conv_bn,quantize{mode=int8_weight_only}"
    "remove_dropout,fixpoint{max_rounds=4}(constant_fold,cse,dce)"

``name{key=value,...}`` sets options (checked against the pass's declared options);
``sequence(...)`` and ``fixpoint{max_rounds=N}(...)`` nest. Values may be quoted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch.fx as fx

from fxopt.errors import NotAPassError, PipelineError
from fxopt.pass_protocol import Option, Pass, as_pass
from fxopt.registry import get_pass_class

PassLike = Pass | type[Pass] | str | Callable[[fx.GraphModule], Any] | Sequence[Any]


class Composite(Pass):
    """A pass made of other passes; the PassManager runs each child transactionally."""

    needs_fake_values = False  # reads no values itself: its children say (needs_fake_values)

    def __init__(self, children: Iterable[PassLike], **options: Any):
        super().__init__(**options)
        self.children: list[Pass] = resolve(children)

    def flatten(self) -> list[Pass]:
        out: list[Pass] = []
        for child in self.children:
            out.extend(child.flatten() if isinstance(child, Composite) else [child])
        return out

    def __repr__(self) -> str:
        return f"{super().__repr__()}({','.join(map(repr, self.children))})"


class SequencePass(Composite):
    """Run the children in order."""

    name = "sequence"


class Fixpoint(Composite):
    """Repeat the children until a whole round changes nothing, at most max_rounds times."""

    name = "fixpoint"
    options: ClassVar = {"max_rounds": Option(int, 10, "upper bound on the rounds", minimum=1)}

    def __init__(self, children: Iterable[PassLike], max_rounds: int = 10):
        super().__init__(children, max_rounds=max_rounds)  # Option(minimum=1) checks the bound


class Conditional(Composite):
    """Run the children only when ``predicate(gm, ctx)`` is true. ``predicate_needs_fake_values``:
    whether the predicate needs FakeTensor values (see ``Pass.needs_fake_values``); say False
    for one that reads no values, or only shapes, dtypes and strides."""

    name = "conditional"

    def __init__(self, predicate: Callable[[fx.GraphModule, Any], bool], children: Iterable[PassLike],
                 name: str | None = None, *, predicate_needs_fake_values: bool = True):
        super().__init__(children)
        self.predicate = predicate
        self.name = name or f"if {getattr(predicate, '__name__', 'predicate')}"
        self.predicate_needs_fake_values = predicate_needs_fake_values


def needs_fake_values(p: Pass) -> bool:
    """Whether ``p``, or any pass or predicate inside it, needs FakeTensor values."""
    if isinstance(p, Composite):
        return (isinstance(p, Conditional) and p.predicate_needs_fake_values) or \
            any(needs_fake_values(child) for child in p.children)
    return p.needs_fake_values


_COMPOSITES: dict[str, type[Composite]] = {"sequence": SequencePass, "fixpoint": Fixpoint}


def resolve(items: PassLike | Iterable[PassLike]) -> list[Pass]:
    """Turn names, textual pipelines, pass objects/classes, callables and nested lists
    into a flat list of top-level Pass objects (composites keep their children)."""
    if isinstance(items, (str, Pass)) or callable(items) and not isinstance(items, (list, tuple)):
        items = [items]
    elif not isinstance(items, Iterable):
        raise NotAPassError(f"passes={items!r} ({type(items).__name__}) is not a pass or pipeline: give "
                            "a pass name, a textual pipeline, a Pass, a function gm -> gm, or a list of these")
    out: list[Pass] = []
    for item in items:
        if isinstance(item, str):
            out.extend(parse_pipeline(item))
        elif isinstance(item, (list, tuple)):
            out.append(SequencePass(item))
        else:
            try:
                out.append(as_pass(item))
            except TypeError as exc:
                raise NotAPassError(str(exc)) from None
    return out


def check_ordering(passes: Sequence[Pass]) -> None:
    """Raise PipelineError if a pass's declared ``after``/``before`` constraints are broken."""
    flat: list[Pass] = []
    for p in passes:
        flat.extend(p.flatten() if isinstance(p, Composite) else [p])
    position: dict[str, list[int]] = {}
    for i, p in enumerate(flat):
        position.setdefault(p.name, []).append(i)
    for i, p in enumerate(flat):
        for other in p.after:
            late = [j for j in position.get(other, []) if j > i]
            if late and not [j for j in position.get(other, []) if j < i]:
                raise PipelineError(f"pass {p.name!r} must run after {other!r}, but {other!r} comes later")
        for other in p.before:
            early = [j for j in position.get(other, []) if j < i]
            if early and not [j for j in position.get(other, []) if j > i]:
                raise PipelineError(f"pass {p.name!r} must run before {other!r}, but {other!r} comes earlier")


# --- the textual syntax -------------------------------------------------------------

_TOKEN = re.compile(r"""\s*(?:(?P<punct>[{}(),=])|(?P<quoted>"[^"]*"|'[^']*')|(?P<word>[^\s{}(),=]+))""")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                if text[pos:].strip() == "":
                    break
                self.fail(pos, "unexpected character")
            kind = m.lastgroup or "word"
            value = m.group(kind)
            if kind == "quoted":
                value = value[1:-1]
            self.tokens.append((kind, value, m.start(kind)))
            pos = m.end()
        self.i = 0

    def fail(self, pos: int, message: str) -> None:
        pointer = " " * pos + "^"
        raise PipelineError(f"pipeline {self.text!r}: {message} at column {pos}\n  {self.text}\n  {pointer}")

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def expect(self, value: str) -> None:
        tok = self.peek()
        if tok is None or tok[1] != value or tok[0] != "punct":
            self.fail(tok[2] if tok else len(self.text), f"expected {value!r}")
        self.i += 1

    def pipeline(self, closing: str | None) -> list[Pass]:
        passes = [self.item()]
        while (tok := self.peek()) is not None and tok[1] == ",":
            self.i += 1
            passes.append(self.item())
        tok = self.peek()
        if closing is None and tok is not None:
            self.fail(tok[2], f"unexpected {tok[1]!r}")
        return passes

    def item(self) -> Pass:
        tok = self.peek()
        if tok is None or tok[0] != "word":
            self.fail(tok[2] if tok else len(self.text), "expected a pass name")
        name = tok[1]
        self.i += 1
        options = self.options() if (t := self.peek()) and t[1] == "{" else {}
        if name in _COMPOSITES:
            self.expect("(")
            children = self.pipeline(closing=")")
            self.expect(")")
            return _COMPOSITES[name](children, **options)
        if (t := self.peek()) and t[1] == "(":
            self.fail(t[2], f"{name!r} is not a composite pass; only {sorted(_COMPOSITES)} take children")
        # unknown names and bad options raise typed errors naming the pass and option
        return get_pass_class(name)(**options)

    def options(self) -> dict[str, str]:
        self.expect("{")
        options: dict[str, str] = {}
        while (tok := self.peek()) is not None and tok[1] != "}":
            if tok[0] == "punct":
                self.fail(tok[2], "expected an option name")
            key = tok[1]
            self.i += 1
            self.expect("=")
            value = self.peek()
            if value is None or value[0] == "punct":
                self.fail(value[2] if value else len(self.text), f"expected a value for option {key!r}")
            if key in options:
                self.fail(tok[2], f"option {key!r} given twice")
            options[key] = value[1]
            self.i += 1
            if (sep := self.peek()) is not None and sep[1] == ",":
                self.i += 1
        self.expect("}")
        return options


def parse_pipeline(text: str) -> list[Pass]:
    """Parse a textual pipeline into Pass objects, validating names and options."""
    if not text.strip():
        raise PipelineError("empty pipeline")
    return _Parser(text).pipeline(closing=None)
