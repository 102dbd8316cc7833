"""Placing buffers in one arena: greedy best-fit, then an exact search when it matters.

``solve`` first runs greedy placements (by size, area and lifetime; best-fit), which
are fast enough for 10k buffers and usually optimal on real graphs. When the best of
them is above the lower bound it searches for a placement at the bound itself, with
the branch-and-bound of MiniMalloc (Moffitt, ASPLOS 2023), reimplemented here:

- *canonical* solutions only: buffers are placed in non-decreasing order of offset (ties
  in a static preorder), each at its gravity offset (just above the highest placed buffer
  it overlaps in time);
- *dominance*: never place a buffer at or above the lowest top any unplaced buffer
  could reach now, because that buffer could go first and fill the gap;
- *inference*: in every section of time, the floor (at least the offset just placed, and
  at least the lowest offset any unplaced buffer there can take) plus the sizes of the
  unplaced buffers there must fit in the capacity;
- *hatless pruning*: a buffer that no unplaced buffer overlaps can go where it is without
  loss, so if that fails, no other choice at this point can succeed;
- *dynamic decomposition*: once no unplaced buffer spans some point of time, the two sides
  are independent problems, each solved (and failed) on its own instead of multiplying;
- several static preorders take turns under a node budget that doubles each round.

Times are closed ranges ``[start, end]``; internally, indices of *sections*: the maximal
sets of buffers live together (the stretch just before some buffer's last point).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fxopt.memory.problem import Buffer, lower_bound

#: problems of at most this many buffers run greedy as plain Python (the very same
#: function, uncompiled): numba's import and first call cost ~0.6 s per process even from
#: its disk cache, more than Python's greedy takes on them (bench/startup.py)
PYTHON_GREEDY_MAX = 300
#: seconds (at most this share of the time limit) the exact search first runs as plain
#: Python on such problems: real graphs usually reach the bound within about one search
#: node per buffer, milliseconds in Python, so numba is loaded only when that fails
PYTHON_SEARCH_SECONDS = 0.1

_JITTED: list[str] = []


def _jit(fn: Callable) -> Callable:
    """Mark ``fn`` for numba; :func:`_compile` compiles it when first needed."""
    _JITTED.append(fn.__name__)
    return fn


@functools.cache
def _compile() -> None:
    """Swap every :func:`_jit` function in this module for its numba dispatcher.

    Done on first need, not at import, so that ``import fxopt`` and small plans never load
    numba. The functions call each other by global name, which numba resolves when it
    compiles, so they are swapped together in the module's namespace. ``cache=True``:
    later processes load the machine code from numba's disk cache.
    """
    import numba

    jit = numba.njit(cache=True, nogil=True)
    namespace = globals()
    for name in _JITTED:
        namespace[name] = jit(namespace[name])


_INF = np.iinfo(np.int64).max // 4
_FOUND, _INFEASIBLE, _ABORTED = 0, 1, 2


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
    if len(sizes) > PYTHON_GREEDY_MAX:
        _compile()
    return _greedy(starts.astype(np.int64), ends.astype(np.int64), sizes.astype(np.int64),
                   order.astype(np.int64))


@_jit
def _greedy(starts, ends, sizes, order):
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


def solve(buffers: Sequence[Buffer], *, time_limit: float | None = 1.0, capacity: int | None = None,
          search_limit: int = 3000) -> Solution:
    """Offsets for ``buffers`` (returned, not written into them) and the resulting arena.

    Greedy first; then, if it is above ``capacity`` (default: the lower bound), the
    branch-and-bound search for up to ``time_limit`` seconds on problems of at most
    ``search_limit`` buffers: at the capacity itself, then (if that fails) at 2%, 5% and
    10% above it. The result is the best placement found either way. ``time_limit=None``:
    no wall-clock limit, each search runs until it finds a placement or proves there is none,
    so the answer does not depend on the machine's speed or load (tests).
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
    if best_arena <= target or n > search_limit or (time_limit is not None and time_limit <= 0):
        return Solution(best.tolist(), best_arena, "greedy", best_arena == bound)
    nodes = 0
    began = time.perf_counter()  # the quick search below spends the same time_limit
    if n <= PYTHON_GREEDY_MAX:
        quick = BranchAndBound(starts, ends, sizes, target, compiled=False, deadline=time.perf_counter()
                               + min(PYTHON_SEARCH_SECONDS, 0.1 * (time_limit or math.inf)))
        found = quick.run()
        nodes = quick.nodes
        if found is not None:
            arena = int((found + sizes).max())
            return Solution(found.tolist(), arena, "search", arena == bound, nodes)
    BranchAndBound.warm_up()
    # most of the time goes to the target itself, then to ever looser capacities (a looser
    # capacity prunes less, so it is not necessarily found sooner); each round gets a share
    # of the time left
    schedule = ((1.0, 0.6), (1.02, 0.4), (1.05, 0.5), (1.10, 1.0))
    best_method = "greedy"
    for factor, share in schedule:
        capacity_now = int(target * factor)
        if capacity_now >= best_arena:
            continue
        left = math.inf if time_limit is None else time_limit - (time.perf_counter() - began)
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
        if factor == 1.0 and best_arena > int(target * 1.10):
            # greedy is more than 10% above and the search found nothing: improve its order
            best, best_arena = _improve_order(starts, ends, sizes, best_order, best, best_arena,
                                              target, rounds=int(200 * (time_limit or 1.0)),
                                              deadline=time.perf_counter() + 0.15 * (time_limit or math.inf))
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
    millions of nodes where a Python loop visits thousands. Python only sets up the
    sections and runs the rounds of preorders and node budgets.
    """

    #: static preorders tried in turn, as MiniMalloc's keys compared in this order, each
    #: descending: W = lifetime, A = size x lifetime, T = the most bytes unplaced in
    #: any section of the buffer when its (sub)problem starts
    HEURISTICS = ("WAT", "TAW", "TWA")

    def __init__(self, starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray, capacity: int,
                 deadline: float, compiled: bool = True):
        self.capacity = int(capacity)
        self.deadline = deadline
        #: False: run the search as plain Python unless numba was loaded already
        self.compiled = compiled
        self.nodes = 0
        self.n = len(sizes)
        self.sizes = sizes.astype(np.int64)
        self.width = (ends - starts + 1).astype(np.int64)
        self.area = self.sizes * self.width
        # elementary stretches between consecutive start/end points; keep only those that
        # end where some buffer ends: every other one holds a subset of the next one
        points = np.unique(np.concatenate([starts, ends + 1]))
        first = np.searchsorted(points, starts)
        last = np.searchsorted(points, ends + 1)
        kept = np.zeros(len(points) - 1, dtype=np.int64)
        kept[last - 1] = 1
        before = np.concatenate([[0], np.cumsum(kept)])
        self.lo = before[first].astype(np.int64)  # first section of each buffer
        self.hi = before[last].astype(np.int64)  # one past its last section
        self.n_sections = int(before[-1])
        members = [np.flatnonzero((self.lo <= s) & (s < self.hi)) for s in range(self.n_sections)]
        self.section_ptr = np.concatenate([[0], np.cumsum([len(m) for m in members])]).astype(np.int64)
        self.section_idx = np.concatenate(members).astype(np.int64)
        overlaps = [np.flatnonzero((self.lo < self.hi[k]) & (self.lo[k] < self.hi) & (np.arange(self.n) != k))
                    for k in range(self.n)]
        self.overlap_ptr = np.concatenate([[0], np.cumsum([len(o) for o in overlaps])]).astype(np.int64)
        self.overlap_idx = np.concatenate(overlaps).astype(np.int64)
        # the most floor changes one path can log: per placement, its own sections and
        # those of the buffers it overlaps (min_off changes: every overlap once)
        reach = sum(int(self.hi[o].max() - self.lo[o].min()) for o in overlaps if len(o))
        self.section_log = int((self.hi - self.lo).sum()) + reach + 1

    @staticmethod
    def warm_up() -> None:
        """Compile the search (or load numba's disk cache) before any time limit starts."""
        one = np.ones(1, dtype=np.int64)
        BranchAndBound(one, one, one, 1, deadline=0.0)._run_search(np.zeros(3, np.int64), 1)

    def run(self) -> np.ndarray | None:
        """Offsets within the capacity, or None (infeasible, or out of time)."""
        budget = self.n
        rate = None  # nodes per second, measured, so a round never overruns the deadline
        while True:
            budget *= 2
            for heuristic in self.HEURISTICS:
                left = self.deadline - time.perf_counter()
                if left <= 0:
                    return None
                limit = budget if rate is None or left == math.inf else min(budget, max(1000, int(rate * left)))
                keys = np.array(["WAT".index(c) for c in heuristic], dtype=np.int64)
                began = time.perf_counter()
                status, offsets, nodes = self._run_search(keys, limit)
                took = time.perf_counter() - began
                self.nodes += nodes
                if took > 0.05:
                    rate = nodes / took
                if status == _FOUND:
                    return offsets
                if status == _INFEASIBLE:
                    return None

    def _run_search(self, keys: np.ndarray, budget: int) -> tuple[int, np.ndarray, int]:
        """One depth-first search under ``budget`` nodes: (status, offsets, nodes visited)."""
        if self.compiled:
            _compile()
        n, n_sections = self.n, self.n_sections
        total = np.zeros(n_sections + 1, dtype=np.int64)
        np.add.at(total, self.lo, self.sizes)
        np.add.at(total, self.hi, -self.sizes)
        cuts = np.zeros(n_sections + 1, dtype=np.int64)  # cuts[k]: buffers spanning k and k + 1
        np.add.at(cuts, self.lo, 1)
        np.add.at(cuts, self.hi - 1, -1)
        state = _State(
            self.sizes, self.width, self.area, self.lo, self.hi, self.overlap_ptr,
            self.overlap_idx, self.section_ptr, self.section_idx, keys, self.capacity,
            np.zeros(n, np.int64), np.full(n, -1, np.int64), np.full(n, -1, np.int64),
            np.zeros(n_sections, np.int64), np.cumsum(total)[:-1], np.cumsum(cuts)[:-1],
            np.zeros(len(self.overlap_idx) + 1, np.int64), np.zeros(len(self.overlap_idx) + 1, np.int64),
            np.zeros(self.section_log, np.int64), np.zeros(self.section_log, np.int64),
            np.array([0, 0, budget, 0], np.int64), np.zeros(n_sections, np.bool_),
            np.zeros(n_sections, np.int64))
        status = _search(state, n_sections)
        return int(status), state.solution, int(state.counts[3])


class _State(NamedTuple):
    """Everything the compiled search reads and changes, in one argument."""

    sizes: np.ndarray
    width: np.ndarray
    area: np.ndarray
    lo: np.ndarray  # first section of each buffer
    hi: np.ndarray  # one past its last section
    overlap_ptr: np.ndarray  # buffers overlapping b: overlap_idx[overlap_ptr[b]:overlap_ptr[b + 1]]
    overlap_idx: np.ndarray
    section_ptr: np.ndarray  # buffers in section k: section_idx[section_ptr[k]:section_ptr[k + 1]]
    section_idx: np.ndarray
    keys: np.ndarray  # the preorder heuristic: 0 = W, 1 = A, 2 = T, most significant first
    capacity: int
    min_off: np.ndarray  # each unplaced buffer's gravity offset
    offsets: np.ndarray  # -1 while unplaced
    solution: np.ndarray  # the offsets of the last placement of each buffer
    floor: np.ndarray  # per section: the lowest offset still usable there
    total: np.ndarray  # per section: bytes of its unplaced buffers
    cuts: np.ndarray  # per section boundary: unplaced buffers spanning it
    log_buf: np.ndarray  # (buffer, old min_off) for every change, to undo them
    log_buf_old: np.ndarray
    log_sec: np.ndarray  # (section, old floor)
    log_sec_old: np.ndarray
    counts: np.ndarray  # lengths of the two logs, nodes left, nodes visited
    affected: np.ndarray  # scratch: sections whose floor may rise
    affected_list: np.ndarray


@_jit
def _preorder(s, part, count):
    """``part[:count]`` sorted by the heuristic's keys, each descending; ties by buffer index."""
    members = np.sort(part[:count])
    tallest = np.zeros(count, np.int64)
    for p in range(count):
        b = members[p]
        for k in range(s.lo[b], s.hi[b]):
            if s.total[k] > tallest[p]:
                tallest[p] = s.total[k]
    # stable sorts from the least significant key to the most significant one
    for c in range(s.keys.shape[0] - 1, -1, -1):
        key = s.keys[c]
        values = np.empty(count, np.int64)
        for p in range(count):
            b = members[p]
            values[p] = -(s.width[b] if key == 0 else s.area[b] if key == 1 else tallest[p])
        order = np.argsort(values, kind="mergesort")
        members = members[order]
        tallest = tallest[order]
    return members


@_jit
def _undo(s, i, mark_buf, mark_sec):
    """Take back the placement of ``i``: the logged floors and offsets, the totals."""
    while s.counts[1] > mark_sec:
        s.counts[1] -= 1
        s.floor[s.log_sec[s.counts[1]]] = s.log_sec_old[s.counts[1]]
    while s.counts[0] > mark_buf:
        s.counts[0] -= 1
        s.min_off[s.log_buf[s.counts[0]]] = s.log_buf_old[s.counts[0]]
    for k in range(s.lo[i], s.hi[i]):
        s.total[k] += s.sizes[i]
    s.offsets[i] = -1


@_jit
def _place(s, i, offset):
    """Put ``i`` at ``offset``; raise the gravity offsets and floors it affects (logged).

    Returns whether ``i`` is *hatless*: no unplaced buffer overlaps it.
    """
    top = offset + s.sizes[i]
    s.offsets[i] = offset
    s.solution[i] = offset
    hatless = True
    n_affected = 0
    for p in range(s.overlap_ptr[i], s.overlap_ptr[i + 1]):
        j = s.overlap_idx[p]
        if s.offsets[j] >= 0:
            continue
        hatless = False
        if s.min_off[j] >= top:
            continue
        s.log_buf[s.counts[0]] = j
        s.log_buf_old[s.counts[0]] = s.min_off[j]
        s.counts[0] += 1
        s.min_off[j] = top
        for k in range(s.lo[j], s.hi[j]):
            if not s.affected[k]:
                s.affected[k] = True
                s.affected_list[n_affected] = k
                n_affected += 1
    for k in range(s.lo[i], s.hi[i]):
        s.log_sec[s.counts[1]] = k
        s.log_sec_old[s.counts[1]] = s.floor[k]
        s.counts[1] += 1
        s.floor[k] = top
        s.total[k] -= s.sizes[i]
    # a section's floor is at least the lowest gravity offset of its unplaced buffers
    for a in range(n_affected):
        k = s.affected_list[a]
        s.affected[k] = False
        lowest = _INF
        for p in range(s.section_ptr[k], s.section_ptr[k + 1]):
            j = s.section_idx[p]
            if s.offsets[j] < 0 and s.min_off[j] < lowest:
                lowest = s.min_off[j]
        if lowest < _INF and s.floor[k] < lowest:
            s.log_sec[s.counts[1]] = k
            s.log_sec_old[s.counts[1]] = s.floor[k]
            s.counts[1] += 1
            s.floor[k] = lowest
    return hatless


@_jit
def _grown(pool, need):
    """``pool``, or a copy twice as large if it holds fewer than ``need`` entries."""
    if need <= pool.shape[0]:
        return pool
    bigger = np.empty(max(need, 2 * pool.shape[0]), np.int64)
    bigger[:pool.shape[0]] = pool
    return bigger


_NODE, _SPLIT, _ENTER = 0, 1, -1


@_jit
def _search(s, n_sections):
    """The depth-first search, iterative (numba cannot cache recursive functions).

    Each frame is a *node* (choose the next buffer of a part: candidates in (gravity
    offset, preorder) order) or a *split* (cut a part where no unplaced buffer crosses a
    section boundary and solve each piece on its own, with a fresh preorder and a fresh
    canonical order). A frame's part is a slice of ``parts``; a node's candidates a
    slice of ``cands``; both are stacks. ``status`` carries a finished child's result
    back to its parent (``_ENTER`` when a frame is new).
    """
    n = s.sizes.shape[0]
    frames = 2 * n + 4  # per placement at most a split and a node, plus the root's two
    kind = np.zeros(frames, np.int64)
    part_at = np.zeros(frames, np.int64)  # the frame's part: parts[part_at:part_at + part_len]
    part_len = np.zeros(frames, np.int64)
    sec_lo = np.zeros(frames, np.int64)  # its sections: [sec_lo, sec_hi)
    sec_hi = np.zeros(frames, np.int64)
    min_offset = np.zeros(frames, np.int64)  # node: canonical order so far
    min_rank = np.zeros(frames, np.int64)
    cand_at = np.zeros(frames, np.int64)  # node: its candidates, cands[cand_at:cand_at + cand_len]
    cand_len = np.zeros(frames, np.int64)
    next_cand = np.zeros(frames, np.int64)
    chosen = np.zeros(frames, np.int64)  # node: the buffer placed for the child frame
    mark_buf = np.zeros(frames, np.int64)
    mark_sec = np.zeros(frames, np.int64)
    hatless = np.zeros(frames, np.bool_)
    begin = np.zeros(frames, np.int64)  # split: the piece being solved is [begin, end)
    end = np.zeros(frames, np.int64)
    parts = np.empty(4 * n, np.int64)
    parts[:n] = np.arange(n)
    cands = np.empty(4 * n, np.int64)
    sort_keys = np.empty(n, np.int64)
    parts_top, cands_top = n, 0
    top = 0
    kind[0], part_at[0], part_len[0], sec_lo[0], sec_hi[0] = _SPLIT, 0, n, 0, n_sections
    status = _ENTER
    while True:
        f = top
        result = _ENTER
        part = parts[part_at[f]:part_at[f] + part_len[f]]
        if kind[f] == _SPLIT:
            if status != _ENTER:  # a piece finished: free it, go on after it
                parts_top = part_at[f + 1]
                if status != _FOUND:
                    result = status
                begin[f] = end[f]
            if result == _ENTER:
                piece_len = 0
                k = begin[f] + 1
                while k <= sec_hi[f]:
                    if k == sec_hi[f] or s.cuts[k - 1] == 0:
                        parts = _grown(parts, parts_top + part_len[f])
                        part = parts[part_at[f]:part_at[f] + part_len[f]]
                        for b in part:
                            if s.offsets[b] < 0 and s.lo[b] < k and begin[f] < s.hi[b]:
                                parts[parts_top + piece_len] = b
                                piece_len += 1
                        if piece_len > 0:
                            break
                        begin[f] = k
                    k += 1
                if piece_len == 0:
                    result = _FOUND
                else:
                    end[f] = k
                    parts[parts_top:parts_top + piece_len] = _preorder(
                        s, parts[parts_top:parts_top + piece_len], piece_len)
                    top += 1
                    kind[top], part_at[top], part_len[top] = _NODE, parts_top, piece_len
                    sec_lo[top], sec_hi[top] = begin[f], k
                    min_offset[top], min_rank[top] = 0, 0
                    parts_top += piece_len
                    status = _ENTER
                    continue
        else:
            scan = True
            if status == _ENTER:
                cand_at[f], cand_len[f], next_cand[f] = cands_top, 0, 0
                if s.counts[2] <= 0:
                    result = _ABORTED
                    scan = False
                else:
                    s.counts[2] -= 1
                    s.counts[3] += 1
                    # dominance: only buffers that can start below the lowest reachable
                    # top are candidates; few, so an insertion sort suffices
                    height = _INF
                    for b in part:
                        if s.offsets[b] < 0 and s.min_off[b] + s.sizes[b] < height:
                            height = s.min_off[b] + s.sizes[b]
                    if height == _INF:
                        result = _FOUND
                        scan = False
                    else:
                        cands = _grown(cands, cands_top + part.shape[0])
                        count = 0
                        for rank in range(part.shape[0]):
                            b = part[rank]
                            if s.offsets[b] < 0 and s.min_off[b] < height:
                                key = s.min_off[b] * (part.shape[0] + 1) + rank
                                c = count
                                while c > 0 and sort_keys[c - 1] > key:
                                    sort_keys[c] = sort_keys[c - 1]
                                    cands[cands_top + c] = cands[cands_top + c - 1]
                                    c -= 1
                                sort_keys[c] = key
                                cands[cands_top + c] = rank
                                count += 1
                        cand_len[f] = count
                        cands_top += count
            else:  # the child of the buffer placed last finished
                i = chosen[f]
                for k in range(s.lo[i], s.hi[i] - 1):
                    s.cuts[k] += 1
                _undo(s, i, mark_buf[f], mark_sec[f])
                if status != _INFEASIBLE:
                    result = status
                    scan = False
                elif hatless[f]:
                    result = _INFEASIBLE
                    scan = False
            pushed = False
            while scan and next_cand[f] < cand_len[f]:
                rank = cands[cand_at[f] + next_cand[f]]
                next_cand[f] += 1
                i = part[rank]
                offset = s.min_off[i]
                # canonical: offsets never decrease along a path, ties in preorder
                if offset < min_offset[f] or (offset == min_offset[f] and rank < min_rank[f]):
                    continue
                mark_buf[f], mark_sec[f] = s.counts[0], s.counts[1]
                hatless[f] = _place(s, i, offset)
                if _fits(s, sec_lo[f], sec_hi[f], offset):
                    cut = False
                    for k in range(s.lo[i], s.hi[i] - 1):
                        s.cuts[k] -= 1
                        cut = cut or s.cuts[k] == 0
                    chosen[f] = i
                    top += 1
                    kind[top], part_at[top], part_len[top] = (_SPLIT if cut else _NODE), part_at[f], part_len[f]
                    sec_lo[top], sec_hi[top] = sec_lo[f], sec_hi[f]
                    min_offset[top], min_rank[top] = offset, rank
                    begin[top] = sec_lo[f]
                    pushed = True
                    break
                _undo(s, i, mark_buf[f], mark_sec[f])
                if hatless[f]:
                    break
            if pushed:
                status = _ENTER
                continue
            if result == _ENTER:
                result = _INFEASIBLE
            cands_top = cand_at[f]
        # frame f is done with ``result``: hand it to its parent
        if f == 0:
            return result
        top -= 1
        status = result


@_jit
def _fits(s, sec_lo, sec_hi, offset):
    """Inference: every section's floor (at least ``offset``) plus its unplaced bytes fits."""
    for k in range(sec_lo, sec_hi):
        floor = s.floor[k] if s.floor[k] > offset else offset
        if floor + s.total[k] > s.capacity:
            return False
    return True
