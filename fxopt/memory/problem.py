"""The static memory-allocation problem: buffers with lifetimes and sizes.

A :class:`Buffer` lives on the closed range of program points ``[start, end]`` and
needs ``size`` bytes. A placement gives each buffer an ``offset`` in one arena; it is
valid when no two buffers that are live at the same time share a byte. The arena can
never be smaller than :func:`lower_bound`, the most bytes live at any one point.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fxopt.errors import FxoptError


class PlacementError(FxoptError, AssertionError):
    """A placement puts two simultaneously live buffers on the same bytes."""


@dataclass
class Buffer:
    """One block of memory: live on program points ``start..end`` (inclusive), ``size`` bytes.

    ``offset`` is None until a planner places it.
    """

    name: str
    start: int
    end: int
    size: int
    offset: int | None = None


def lower_bound(buffers: Iterable[Buffer]) -> int:
    """The maximum, over program points, of the bytes live at that point."""
    delta: dict[int, int] = {}
    for b in buffers:
        delta[b.start] = delta.get(b.start, 0) + b.size
        delta[b.end + 1] = delta.get(b.end + 1, 0) - b.size
    live = peak = 0
    for t in sorted(delta):
        live += delta[t]
        peak = max(peak, live)
    return peak


def arena_size(buffers: Iterable[Buffer]) -> int:
    """Bytes the arena needs for a placement: the highest end of any buffer."""
    return max((b.offset + b.size for b in buffers if b.offset is not None), default=0)


def verify_placement(buffers: Sequence[Buffer], capacity: int | None = None) -> None:
    """Raise :class:`PlacementError` naming the first two buffers that overlap in time and space.

    Two buffers overlap in time exactly when one starts while the other is live, so a
    sweep over start times compares each buffer only with those live at its start.
    """
    for b in buffers:
        if b.offset is None or b.offset < 0:
            raise PlacementError(f"buffer {b.name!r} has no valid offset ({b.offset!r})")
        if capacity is not None and b.offset + b.size > capacity:
            raise PlacementError(f"buffer {b.name!r} ends at {b.offset + b.size} > capacity {capacity}")
    events = sorted(((b.start, 0, i) for i, b in enumerate(buffers) if b.size > 0))
    ends = sorted(((b.end, i) for i, b in enumerate(buffers) if b.size > 0))
    live: list[int] = []
    j = 0
    for start, _, i in events:
        while j < len(ends) and ends[j][0] < start:
            live.remove(ends[j][1])
            j += 1
        b = buffers[i]
        for k in live:
            o = buffers[k]
            if b.offset < o.offset + o.size and o.offset < b.offset + b.size:
                raise PlacementError(
                    f"buffers {o.name!r} [{o.start},{o.end}]@{o.offset}+{o.size} and "
                    f"{b.name!r} [{b.start},{b.end}]@{b.offset}+{b.size} overlap")
        live.append(i)
