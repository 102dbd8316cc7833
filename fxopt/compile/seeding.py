"""Seeding torch's random number generator for a reference run, only where it matters.

Ops inside a model draw from torch's one CPU generator; no generator can be handed to them.
Seeding it is therefore a process-wide change: while it lasts, every thread that draws
random numbers draws from the seeded state, and putting the state back afterwards throws
away what they drew. A graph that draws no random numbers computes the same with any seed,
so it runs unseeded and the generator is never touched: only a graph with a random node,
or with an op fxopt does not know (which may be random: :mod:`fxopt.analysis.ops`), is
run seeded (docs/passes.md, "Threads").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from fxopt.analysis.ops import facts


def may_draw_random(model: Any) -> bool:
    """Whether running ``model`` may draw random numbers: a GraphModule with a random or
    unknown node (op facts); any other callable, since it cannot be looked into."""
    if not isinstance(model, fx.GraphModule):
        return True
    for node in model.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            node_facts = facts(node)
            if node_facts.random or node_facts.unknown:
                return True
    return False


@contextlib.contextmanager
def seeded(model: Any, seed: int) -> Iterator[None]:
    """Run the block with torch's CPU generator seeded with ``seed`` (and put back after)
    if ``model`` may draw random numbers; otherwise leave the generator alone."""
    if not may_draw_random(model):
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
