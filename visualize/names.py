"""Names in drawn text, replaced by numbered slots: how repeated structure is recognised.

Block 5 and block 6 of a stack draw the same picture except for names (``drop_5`` /
``blocks.5.drop`` against ``drop_6`` / ``blocks.6.drop``). Replacing every name in a text
by the number of its first appearance gives both the same *shape*, so one drawing can
stand for both: a diff draws one example of a repeated change, and the whole-graph view
lays out one block and shows any other by swapping the names back in (``report.js``
tokenizes the drawn text with the same expression, :data:`NAME_PATTERN`).

A *name* is a node name or a qualified module or attribute name of the graph (only those:
op names, dtypes and numbers stay as they are, so ``relu`` against ``gelu`` is a different
shape).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch.fx as fx

#: a dotted path of words (``blocks.5.lin``, and ``0.lin``: the children of a Sequential are
#: numbers); the same expression is in report.js
NAME_PATTERN = r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*"
_SPLIT = re.compile(f"({NAME_PATTERN})")


def graph_names(graphs: Iterable[fx.Graph], scopes: Iterable[str] = ()) -> set[str]:
    """Every node name of ``graphs``, the qualified targets of their call_module and
    get_attr nodes with each of their prefixes, and the module ``scopes`` given."""
    names = set(scopes)
    for graph in graphs:
        for node in graph.nodes:
            names.add(node.name)
            if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
                parts = node.target.split(".")
                names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def blank(text: str, known: set[str]) -> tuple[str, tuple[str, ...]]:
    """``text`` with each known name replaced by ``\\x00``, and those names in order."""
    pieces = _SPLIT.split(text)
    names = tuple(p for p in pieces[1::2] if p in known)
    if not names:
        return text, ()
    for i in range(1, len(pieces), 2):
        if pieces[i] in known:
            pieces[i] = "\x00"
    return "".join(pieces), names


class Shape:
    """Texts with their names replaced by slots: ``shape`` is comparable (and hashable),
    ``names`` the names in slot order (the first name seen is slot 0, and a repeated name
    keeps its slot)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._slot: dict[str, int] = {}
        self.parts: list[tuple[str, tuple[int, ...]]] = []

    def add(self, blanked: tuple[str, tuple[str, ...]]) -> None:
        """Add one text as :func:`blank` returned it."""
        text, names = blanked
        slots = []
        for name in names:
            slot = self._slot.get(name)
            if slot is None:
                slot = self._slot[name] = len(self.names)
                self.names.append(name)
            slots.append(slot)
        self.parts.append((text, tuple(slots)))

    @property
    def shape(self) -> tuple:
        return tuple(self.parts)
