"""Provenance: which original nodes a rewritten node stands for.

Passes call :func:`record_replacement` for every node they create in place of others;
the visual diff pairs nodes across a rewrite with it, and ``fxopt.testing`` uses it to
localize the first diverging node. Names (not Node objects) are stored so that the
information survives snapshots and copies. Provenance composes: a node that replaces
an already-rewritten node inherits that node's origins.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx as fx

PROVENANCE_KEY = "fxopt.replaces"


def origins(node: fx.Node) -> list[str]:
    """Names of the original nodes ``node`` stands for (itself, if never rewritten)."""
    return list(node.meta.get(PROVENANCE_KEY, [node.name]))


def record_replacement(new: fx.Node, replaced: Iterable[fx.Node], pass_name: str | None = None) -> None:
    """Record that ``new`` replaces the nodes in ``replaced`` (and what they replaced):
    every origin once, in first-seen order (a dict, so long histories stay linear)."""
    names = [*new.meta.get(PROVENANCE_KEY, ())]
    for old in replaced:
        names += old.meta.get(PROVENANCE_KEY, (old.name,))
    new.meta[PROVENANCE_KEY] = list(dict.fromkeys(names))
    if pass_name is not None:
        new.meta["fxopt.created_by"] = pass_name
