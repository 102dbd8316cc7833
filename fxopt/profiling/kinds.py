"""Op kinds for the hotspot table: what sort of work a node's ATen ops do.

The kind is read from torch's own knowledge of each op where it has some: ops
``torch.utils.flop_counter`` has a FLOP formula for are the compute-bound ones (a
convolution, else a matmul/attention), the ``pointwise`` and ``reduction`` tags of the op
schema, and the schema's alias annotations for views. Only the names of normalisations, softmax and
pooling (counted as reductions) and copies/layout conversions, which torch does not tag,
are matched by name. This is a
reporting category; it says nothing about effects (those live in :mod:`fxopt.analysis`).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import torch
from torch.utils.flop_counter import flop_registry

#: kinds, from the most to the least compute-heavy; a node running ops of several kinds
#: (a call_module, a fused op) gets the first kind in this order
KINDS = ("conv", "matmul", "norm", "reduction", "pointwise", "copy/layout", "other")

_COPIES = frozenset({"copy_", "clone", "contiguous", "to", "_to_copy", "cat", "stack", "pad",
                     "constant_pad_nd", "_unsafe_view", "index_select", "gather", "scatter"})


@cache
def _packet(name: str) -> torch._ops.OpOverloadPacket | None:
    namespace, _, op = name.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None


def _overloads(packet: torch._ops.OpOverloadPacket) -> Iterable[torch._ops.OpOverload]:
    for name in packet.overloads():
        yield getattr(packet, name)


_REDUCTION_TAG = getattr(torch.Tag, "reduction", None)  # not in every supported torch


@cache
def op_kind(name: str) -> str:
    """The kind of one profiler op name (``"aten::addmm"``), one of :data:`KINDS`."""
    short = name.partition("::")[2] or name
    packet = _packet(name) if "::" in name else None
    if packet is not None and packet in flop_registry:
        return "conv" if "conv" in short else "matmul"
    if "conv" in short:
        return "conv"
    if short in ("linear", "matmul", "einsum") or "attention" in short:
        return "matmul"
    if "norm" in short and not short.startswith(("frobenius", "nuclear", "linalg")):
        return "norm"
    if "softmax" in short or "pool" in short:
        return "reduction"
    if short in _COPIES:
        return "copy/layout"
    if packet is None:
        return "other"
    overloads = list(_overloads(packet))
    if _REDUCTION_TAG is not None and any(_REDUCTION_TAG in o.tags for o in overloads):
        return "reduction"
    if any(torch.Tag.pointwise in o.tags for o in overloads):
        return "pointwise"
    if overloads and all(_is_view(o) for o in overloads):
        return "copy/layout"
    return "other"


def _is_view(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def node_kind(op_names: Iterable[str]) -> str:
    """The kind of a node that ran ``op_names`` (its top-level ops): the heaviest kind."""
    kinds = {op_kind(n) for n in op_names}
    return next((k for k in KINDS if k in kinds), "other")
