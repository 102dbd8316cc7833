"""Placing buffers in one arena: greedy best-fit, then an exact search when it matters.

``solve`` first runs greedy placements (by size, area and lifetime; best-fit), which
are fast enough for 10k buffers and usually optimal on real graphs. When the best of
them is above the lower bound it searches for a placement at the bound itself, with
the branch-and-bound of MiniMalloc (Moffitt, ASPLOS 2023), reimplemented here:

- *canonical* solutions only: buffers are placed in non-decreasing order of offset, each
  at its gravity offset (just above the highest placed buffer it overlaps in time);
- *dominance*: never place a buffer at or above the lowest top any unplaced buffer
  could reach now, because that buffer could go first and fill the gap;
- *inference*: in every section of time, the floor plus the sizes of the unplaced
  buffers there must fit in the capacity;
- independent partitions of time are solved separately, and several static orderings
  take turns under a node budget that doubles each round.

Times are closed ranges ``[start, end]``; internally half-open section indices.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fxopt.memory.problem import Buffer, lower_bound

_INF = np.iinfo(np.int64).max // 4


@dataclass
class Solution:
    offsets: list[int]
    arena: int
    #: "greedy" or "search"; ``optimal`` means arena equals the lower bound
    method: str
    optimal: bool
    nodes: int = 0


def greedy(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Place buffers in ``order``, each in the smallest gap that fits (best fit) or on top."""
    return _compiled("greedy")(starts.astype(np.int64), ends.astype(np.int64), sizes.astype(np.int64),
                               order.astype(np.int64))


def _greedy_py(starts, ends, sizes, order):
    n = sizes.shape[0]
    offsets = np.zeros(n, np.int64)
    p_start = np.empty(n, np.int64)
    p_end = np.empty(n, np.int64)
    p_lo = np.empty(n, np.int64)
    p_hi = np.empty(n, np.int64)
    hit_lo = np.empty(n, np.int64)
    hit_hi = np.empty(n, np.int64)
    for k in range(n):
        i = order[k]
        size = sizes[i]
        count = 0
        for j in range(k):
            if p_start[j] <= ends[i] and p_end[j] >= starts[i]:
                hit_lo[count] = p_lo[j]
                hit_hi[count] = p_hi[j]
                count += 1
        by_offset = np.argsort(hit_lo[:count], kind="mergesort")
        best, best_gap, cursor = -1, np.int64(-1), np.int64(0)
        for c in range(count):
            lo, hi = hit_lo[by_offset[c]], hit_hi[by_offset[c]]
            gap = lo - cursor
            if gap >= size and (best_gap < 0 or gap < best_gap):
                best, best_gap = cursor, gap
            if hi > cursor:
                cursor = hi
        offset = best if best >= 0 else cursor
        offsets[i] = offset
        p_start[k], p_end[k], p_lo[k], p_hi[k] = starts[i], ends[i], offset, offset + size
    return offsets


def _orders(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, many: bool) -> list[np.ndarray]:
    length = ends - starts + 1
    index = np.arange(len(sizes))
    orders = [np.lexsort((index, -length, -sizes))]  # greedy by size (ties: longer first)
    if many:
        orders.append(np.lexsort((index, -sizes, -(sizes * length))))  # by area
        orders.append(np.lexsort((index, -sizes, -length)))  # by lifetime
    return orders


def solve(buffers: Sequence[Buffer], *, time_limit: float = 1.0, capacity: int | None = None,
          search_limit: int = 3000) -> Solution:
    """Offsets for ``buffers`` (returned, not written into them) and the resulting arena.

    Greedy first; then, if it is above ``capacity`` (default: the lower bound), the
    branch-and-bound search for up to ``time_limit`` seconds on problems of at most
    ``search_limit`` buffers: at the capacity itself, then (if that fails) at up to 10%
    above it. The result is the best placement found either way.
    """
    n = len(buffers)
    if n == 0:
        return Solution([], 0, "greedy", True)
    starts = np.array([b.start for b in buffers], dtype=np.int64)
    ends = np.array([b.end for b in buffers], dtype=np.int64)
    sizes = np.array([b.size for b in buffers], dtype=np.int64)
    bound = lower_bound(buffers)
    target = bound if capacity is None else capacity
    best: np.ndarray | None = None
    best_arena = best_order = None
    for order in _orders(starts, ends, sizes, many=n <= 2000):
        offsets = greedy(starts, ends, sizes, order)
        arena = int((offsets + sizes).max())
        if best_arena is None or arena < best_arena:
            best, best_arena, best_order = offsets, arena, order
        if best_arena <= target:
            break
    assert best is not None and best_arena is not None and best_order is not None
    if best_arena <= target or n > search_limit or time_limit <= 0:
        return Solution(best.tolist(), best_arena, "greedy", best_arena == bound)
    _compiled("search")
    # first secure a placement at most 10% above the target, then spend most of the time
    # on the target itself, then on the capacities in between
    began, nodes = time.perf_counter(), 0
    schedule = ((1.10, 0.2), (1.0, 0.75), (1.02, 0.5), (1.05, 1.0))
    best_method = "greedy"
    for factor, share in schedule:
        capacity_now = int(target * factor)
        if capacity_now >= best_arena:
            continue
        left = time_limit - (time.perf_counter() - began)
        if left <= 0:
            break
        search = BranchAndBound(starts, ends, sizes, capacity_now,
                                deadline=time.perf_counter() + left * share)
        found = search.run()
        nodes += search.nodes
        if found is not None:
            arena = int((found + sizes).max())
            if arena < best_arena:
                best, best_arena, best_method = found, arena, "search"
            if best_arena <= target:
                break
        if factor == 1.10 and best_arena > capacity_now:
            # the search could not even secure 10%: improve greedy's order instead
            best, best_arena = _improve_order(starts, ends, sizes, best_order, best, best_arena,
                                              target, rounds=int(200 * time_limit),
                                              deadline=time.perf_counter() + 0.15 * time_limit)
    return Solution(best.tolist(), best_arena, best_method, best_arena == bound, nodes)


def _improve_order(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, order: np.ndarray,
                   offsets: np.ndarray, arena: int, target: int, rounds: int,
                   deadline: float) -> tuple[np.ndarray, int]:
    """Local search over greedy orders: swap two buffers, keep the order if no worse.

    A fixed seed and number of rounds keep it deterministic unless the deadline (a share
    of the caller's time limit) cuts it short; it cheaply pulls greedy's placement down
    before the exact search.
    """
    rng = np.random.default_rng(0)
    order = order.copy()
    n = len(order)
    for _ in range(rounds):
        if time.perf_counter() > deadline:
            break
        i, j = rng.integers(0, n, size=2)
        order[i], order[j] = order[j], order[i]
        trial = greedy(starts, ends, sizes, order)
        trial_arena = int((trial + sizes).max())
        if trial_arena <= arena:
            offsets, arena = trial, trial_arena
            if arena <= target:
                break
        else:
            order[i], order[j] = order[j], order[i]
    return offsets, arena


class BranchAndBound:
    """MiniMalloc-style search for a placement within ``capacity`` (see the module doc).

    The depth-first search itself is :func:`_search`, compiled with numba: it visits
    millions of nodes where a Python loop visits thousands.
    """

    #: static orderings tried in turn: (sections spanned, area, section total), descending,
    #: in MiniMalloc's three permutations
    HEURISTICS = ("WAT", "TAW", "TWA")

    def __init__(self, starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, capacity: int,
                 deadline: float):
        self.sizes = sizes.astype(np.int64)
        self.capacity = int(capacity)
        self.deadline = deadline
        self.nodes = 0
        points = np.unique(np.concatenate([starts, ends + 1]))
        self.lo = np.searchsorted(points, starts).astype(np.int64)  # first section of each buffer
        self.hi = np.searchsorted(points, ends + 1).astype(np.int64)  # one past its last section
        self.n_sections = len(points) - 1
        self.n = len(sizes)
        self.totals = np.zeros(self.n_sections + 1, dtype=np.int64)
        np.add.at(self.totals, self.lo, self.sizes)
        np.add.at(self.totals, self.hi, -self.sizes)
        self.totals = np.cumsum(self.totals)[:-1]

    def _preorder(self, buffers: np.ndarray, heuristic: str) -> np.ndarray:
        width = self.hi[buffers] - self.lo[buffers]
        keys = {
            "W": width,
            "A": self.sizes[buffers] * width,
            "T": np.array([self.totals[self.lo[b]:self.hi[b]].max() for b in buffers.tolist()]),
        }
        # lexsort sorts by its last key first; negate for descending
        return buffers[np.lexsort(tuple(-keys[c] for c in reversed(heuristic)))]

    def _partitions(self) -> list[np.ndarray]:
        """Groups of buffers with no buffer crossing between groups: solved independently."""
        order = np.argsort(self.lo, kind="stable")
        parts, current, reach = [], [], -1
        for b in order.tolist():
            if current and self.lo[b] >= reach:
                parts.append(np.array(current, dtype=np.int64))
                current = []
            current.append(b)
            reach = max(reach, int(self.hi[b]))
        parts.append(np.array(current, dtype=np.int64))
        return parts

    def run(self) -> np.ndarray | None:
        """Offsets within the capacity, or None (infeasible, or out of time)."""
        offsets = np.zeros(self.n, dtype=np.int64)
        for part in self._partitions():
            found = self._solve_part(part)
            if found is None:
                return None
            offsets[part] = found
        return offsets

    def _solve_part(self, part: np.ndarray) -> np.ndarray | None:
        problems = [self._compile_problem(self._preorder(part, h)) for h in self.HEURISTICS]
        budget = 2 * len(part)
        rate = None  # nodes per second, measured, so a round never overruns the deadline
        while True:
            budget *= 2
            for preorder, problem in problems:
                left = self.deadline - time.perf_counter()
                if left <= 0:
                    return None
                limit = budget if rate is None else min(budget, max(1000, int(rate * left)))
                began = time.perf_counter()
                status, offsets, nodes = _search(*problem, self.capacity, limit)
                took = time.perf_counter() - began
                self.nodes += nodes
                if took > 0.05:
                    rate = nodes / took
                if status == _FOUND:
                    result = np.empty(len(part), dtype=np.int64)
                    position = {int(b): i for i, b in enumerate(preorder.tolist())}
                    for k, b in enumerate(part.tolist()):
                        result[k] = offsets[position[b]]
                    return result
                if status == _INFEASIBLE:
                    return None

    def _compile_problem(self, preorder: np.ndarray) -> tuple:
        """Arrays for :func:`_search`, with buffers renumbered in ``preorder``."""
        m = len(preorder)
        rank = np.full(self.n, -1, dtype=np.int64)
        rank[preorder] = np.arange(m)
        lo, hi, sizes = self.lo[preorder], self.hi[preorder], self.sizes[preorder]
        overlap_ptr = np.zeros(m + 1, dtype=np.int64)
        overlap_lists = []
        for k in range(m):
            others = np.flatnonzero((lo < hi[k]) & (lo[k] < hi))
            others = others[others != k]
            overlap_lists.append(others)
            overlap_ptr[k + 1] = overlap_ptr[k] + len(others)
        overlap_idx = np.concatenate(overlap_lists).astype(np.int64) if m > 1 else np.zeros(0, np.int64)
        section_lists = [[] for _ in range(self.n_sections)]
        for k in range(m):
            for sec in range(lo[k], hi[k]):
                section_lists[sec].append(k)
        section_ptr = np.zeros(self.n_sections + 1, dtype=np.int64)
        for sec in range(self.n_sections):
            section_ptr[sec + 1] = section_ptr[sec] + len(section_lists[sec])
        section_idx = np.array([k for lst in section_lists for k in lst], dtype=np.int64)
        first, last = int(lo.min()), int(hi.max())
        return preorder, (sizes, lo, hi, overlap_ptr, overlap_idx, section_ptr, section_idx,
                          first, last)


_FOUND, _INFEASIBLE, _BUDGET = 0, 1, 2


def _search(sizes, lo, hi, overlap_ptr, overlap_idx, section_ptr, section_idx, first, last,
            capacity, budget):
    return _compiled("search")(sizes, lo, hi, overlap_ptr, overlap_idx, section_ptr, section_idx,
                               first, last, capacity, budget)


_COMPILED: dict[str, object] = {}


def _compiled(name: str):
    """The numba-compiled kernel ``name`` (compiled on first use, then cached on disk)."""
    if name not in _COMPILED:
        try:
            import numba
        except ImportError:  # the same code runs as Python, only much slower
            return _greedy_py if name == "greedy" else _search_py

        vector = numba.int64[:]
        if name == "greedy":
            signature = vector(vector, vector, vector, vector)
            _COMPILED[name] = numba.njit(signature, cache=True, nogil=True)(_greedy_py)
        else:
            signature = numba.types.Tuple((numba.int64, vector, numba.int64))(
                vector, vector, vector, vector, vector, vector, vector,
                numba.int64, numba.int64, numba.int64, numba.int64)
            # an explicit signature compiles now (or loads numba's disk cache), so compile
            # time never eats into a search's time limit
            _COMPILED[name] = numba.njit(signature, cache=True, nogil=True)(_search_py)
    return _COMPILED[name]


def _search_py(sizes, lo, hi, overlap_ptr, overlap_idx, section_ptr, section_idx, first, last,
               capacity, budget):
    """Iterative depth-first search; returns (status, offsets in preorder, nodes visited).

    State: each unplaced buffer's gravity offset ``min_off``; each section's ``floor``
    (lowest offset still usable there) and ``total`` (bytes of its unplaced buffers).
    Every change is logged so that backtracking restores it exactly.
    """
    m = sizes.shape[0]
    n_sections = section_ptr.shape[0] - 1
    min_off = np.zeros(m, np.int64)
    placed = np.zeros(m, np.bool_)
    offsets = np.full(m, -1, np.int64)
    floor = np.zeros(n_sections, np.int64)
    total = np.zeros(n_sections, np.int64)
    for k in range(m):
        for sec in range(lo[k], hi[k]):
            total[sec] += sizes[k]
    cand = np.zeros((m + 1, m), np.int64)
    n_cand = np.zeros(m + 1, np.int64)
    pos = np.zeros(m + 1, np.int64)
    min_height = np.zeros(m + 1, np.int64)
    chosen = np.full(m + 1, -1, np.int64)
    log_buf = np.zeros(m * m + 1, np.int64)  # (buffer, old min_off) pairs, flattened
    log_buf_old = np.zeros(m * m + 1, np.int64)
    n_log_buf = 0
    log_sec = np.zeros(4 * m * (n_sections + 1) + 1, np.int64)
    log_sec_old = np.zeros(4 * m * (n_sections + 1) + 1, np.int64)
    n_log_sec = 0
    mark_buf = np.zeros(m + 1, np.int64)
    mark_sec = np.zeros(m + 1, np.int64)
    affected = np.zeros(n_sections, np.bool_)
    keys = np.zeros(m, np.int64)
    nodes = 0
    depth = 0
    need_candidates = True
    while True:
        if need_candidates:
            need_candidates = False
            nodes += 1
            if depth == m:
                return 0, offsets, nodes
            if nodes > budget:
                return 2, offsets, nodes
            height = np.int64(1) << 62
            for k in range(m):
                if not placed[k] and min_off[k] + sizes[k] < height:
                    height = min_off[k] + sizes[k]
            # dominance: only buffers that can start below the lowest reachable top are
            # candidates; they are few, so an insertion sort by (offset, preorder) suffices
            count = 0
            for k in range(m):
                if not placed[k] and min_off[k] < height:
                    key = min_off[k] * (m + 1) + k
                    c = count
                    while c > 0 and keys[c - 1] > key:
                        keys[c] = keys[c - 1]
                        cand[depth, c] = cand[depth, c - 1]
                        c -= 1
                    keys[c] = key
                    cand[depth, c] = k
                    count += 1
            n_cand[depth] = count
            pos[depth] = 0
            min_height[depth] = height
        advanced = False
        while pos[depth] < n_cand[depth]:
            i = cand[depth, pos[depth]]
            pos[depth] += 1
            offset = min_off[i]
            if depth > 0:
                prev = chosen[depth - 1]
                if offset < offsets[prev] or (offset == offsets[prev] and i < prev):
                    continue
            top = offset + sizes[i]
            if top > capacity:
                continue
            # place i
            mark_buf[depth] = n_log_buf
            mark_sec[depth] = n_log_sec
            placed[i] = True
            offsets[i] = offset
            for p in range(overlap_ptr[i], overlap_ptr[i + 1]):
                j = overlap_idx[p]
                if not placed[j] and min_off[j] < top:
                    log_buf[n_log_buf] = j
                    log_buf_old[n_log_buf] = min_off[j]
                    n_log_buf += 1
                    min_off[j] = top
                    for sec in range(lo[j], hi[j]):
                        affected[sec] = True
            for sec in range(lo[i], hi[i]):
                log_sec[n_log_sec] = sec
                log_sec_old[n_log_sec] = floor[sec]
                n_log_sec += 1
                floor[sec] = top
                total[sec] -= sizes[i]
            for sec in range(first, last):
                if affected[sec]:
                    affected[sec] = False
                    lowest = np.int64(1) << 62
                    for p in range(section_ptr[sec], section_ptr[sec + 1]):
                        j = section_idx[p]
                        if not placed[j] and min_off[j] < lowest:
                            lowest = min_off[j]
                    if lowest < (np.int64(1) << 62) and floor[sec] < lowest:
                        log_sec[n_log_sec] = sec
                        log_sec_old[n_log_sec] = floor[sec]
                        n_log_sec += 1
                        floor[sec] = lowest
            feasible = True
            for sec in range(first, last):
                f = floor[sec] if floor[sec] > offset else offset
                if f + total[sec] > capacity:
                    feasible = False
                    break
            if feasible:
                chosen[depth] = i
                depth += 1
                need_candidates = True
                advanced = True
                break
            # undo
            while n_log_sec > mark_sec[depth]:
                n_log_sec -= 1
                floor[log_sec[n_log_sec]] = log_sec_old[n_log_sec]
            while n_log_buf > mark_buf[depth]:
                n_log_buf -= 1
                min_off[log_buf[n_log_buf]] = log_buf_old[n_log_buf]
            for sec in range(lo[i], hi[i]):
                total[sec] += sizes[i]
            placed[i] = False
            offsets[i] = -1
        if advanced:
            continue
        # every candidate at this depth failed: backtrack
        if depth == 0:
            return 1, offsets, nodes
        depth -= 1
        i = chosen[depth]
        while n_log_sec > mark_sec[depth]:
            n_log_sec -= 1
            floor[log_sec[n_log_sec]] = log_sec_old[n_log_sec]
        while n_log_buf > mark_buf[depth]:
            n_log_buf -= 1
            min_off[log_buf[n_log_buf]] = log_buf_old[n_log_buf]
        for sec in range(lo[i], hi[i]):
            total[sec] += sizes[i]
        placed[i] = False
        offsets[i] = -1
        chosen[depth] = -1
