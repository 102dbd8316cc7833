"""Replay a compiled inference graph as CUDA graphs, invisibly to the caller.

Why. A compiled conv net at batch 32 spends more host time launching its ~100 kernels
(Inductor's Python wrapper, ~20 us each) than the GPU spends running them: resnet50 on an
H100 takes 2.1 ms of host time per call for 1.3 ms of GPU work (bench/RESULTS.md). Fusing
kernels barely moves that. A CUDA graph launches them all in one call. Inductor offers
this as ``mode="reduce-overhead"``, but its outputs live in the graph's memory pool and
are overwritten by the next call, a change of semantics users must know about. Here the
caller sees the plain compiled function's semantics:

* inputs are copied into the graph's own input buffers, so any tensor may be passed;
* outputs are cloned out of the pool, so every call returns fresh tensors that no later
  call touches;
* a graph is replayed only when :func:`refusal` finds nothing a replay would change: an
  inference graph on CUDA tensors (and integer sizes), whose every op the op-facts model
  knows (no random draws, no collectives, no state updates, no unknown ops), that writes
  none of its inputs (writes into its own intermediates replay alike), whose sizes do not
  depend on data, and whose outputs share no storage with its inputs or with each other.
  Anything else runs the compiled function as is;
* a call made while the caller captures a CUDA graph of their own runs the compiled
  function as is (counted in :class:`ReplayLog`).

Shapes. A graph with symbolic sizes (Dynamo's automatic dynamic shapes after a second
batch size, ``dynamic=True``, ``mark_dynamic``) runs one compiled function for every size,
taking the sizes as int arguments. A CUDA graph is fixed to the sizes it was captured
with, so one is captured per *call signature* (:func:`signature`: every tensor's shape,
strides, dtype and device, every int's value), kept in a bounded
least-recently-used :class:`ShapeCache` (``replay_shapes`` of the backend, default 8).
All captures of one compiled function share one memory pool, as Inductor's CUDA-graph
trees do: each capture's intermediates are scratch reused by the next, and since every
replay's outputs are cloned out before anything else runs on the stream, one graph's
replay may overwrite another's outputs in the pool harmlessly. Memory: the pool holds
about the largest capture's intermediates plus every cached capture's outputs, and each
capture keeps its own input buffers. A new shape that finds the cache full runs plain,
and takes the least recently used capture's place only if it comes back before that
capture is used again, so a one-off (an epoch's last, partial batch) evicts nothing
(:class:`ShapeBook`). A shape that
comes back after being evicted means the working set of shapes exceeds the bound: rather
than capture again and again, such shapes run plain, with a warning and a count in the log.

Per signature, the first call runs the compiled function (it compiles and tunes kernels);
the second captures, after one warm-up on a side stream as CUDA requires, then times
replays against plain calls, interleaved, and keeps replaying unless plain calls are
faster by more than :data:`PLAIN_MARGIN`: a GPU-bound graph gains nothing from a replay
and still pays for the input copies and output clones (a Llama-shaped decoder on an H100
ran 5% slower replayed, bench/RESULTS.md), while at a tie replay wins, as it frees the
host (and a noisy tie must not flip a GPU-bound conv net to plain launches).
:class:`ReplayLog` (``CompiledGraph.replay`` in the backend's reports) says what ran for
each signature and why.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten, tree_map

from fxopt.analysis import ops
from fxopt.analysis.alias import storages_of, traced_value

__all__ = ["GraphReplay", "ReplayLog", "ShapeBook", "ShapeCache", "refusal", "signature"]


def refusal(gm: fx.GraphModule, example_inputs: Sequence[Any], *, training: bool) -> str | None:
    """Why replaying ``gm`` as CUDA graphs could differ from running it (None: it cannot).

    ``gm`` is the torch-level graph handed to Inductor, with Dynamo's example values in
    ``meta['val']``; ``example_inputs`` are the inputs the compiled function takes
    (tensors, and ints or SymInts for the sizes of a graph with dynamic shapes).
    """
    if training:
        return "a training graph (autograd records the call)"
    for index, value in enumerate(example_inputs):
        if isinstance(value, int | torch.SymInt) and not isinstance(value, bool):
            continue  # a size: part of the signature a capture is kept under
        if not isinstance(value, torch.Tensor):
            return f"input {index} is not a tensor or an int ({type(value).__name__})"
        if value.device.type != "cuda":
            return f"input {index} is on {value.device}"
    placeholders = set(gm.graph.find_nodes(op="placeholder"))
    inputs = set().union(*(storages_of(traced_value(n)) for n in placeholders))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        facts = ops.facts(node)
        if facts.random or facts.collective or facts.stateful or facts.unknown:
            return f"node {node.name} is not known to be pure ({facts.reason or 'effects'})"
        for written in facts.writes:  # a write into the graph's own tensors replays alike
            if storages_of(traced_value(written)) & inputs or traced_value(written) is None:
                return f"node {node.name} writes input {written.name}"
        if free_unbacked_symbols(traced_value(node)):  # e.g. nonzero, .item(): sizes from data
            return f"node {node.name} has a size that depends on data"
    seen: set = set()
    for index, out in enumerate(tree_flatten(gm.graph.output_node().args[0])[0]):
        value = traced_value(out) if isinstance(out, fx.Node) else out
        if not isinstance(value, torch.Tensor) or value.device.type != "cuda":
            return f"output {index} is not a CUDA tensor"
        storages = storages_of(value)
        if storages & inputs:
            return f"output {index} shares storage with an input"
        if storages & seen:
            return f"output {index} shares storage with another output"
        seen |= storages
    return None


def signature(args: Sequence[Any]) -> tuple | None:
    """What a call must match to be served by a capture: each tensor's shape, strides, dtype
    and device, each int's value (the sizes a dynamic-shape graph takes); None if some
    argument is neither (:func:`refusal` admits no other kind of input)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device))
        elif isinstance(a, int):
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def describe(key: tuple) -> str:
    """A signature as a person reads it: ``bfloat16[32, 3, 224, 224]/(150528, 1, 672, 3)``."""
    parts = []
    for item in key:
        if isinstance(item[0], torch.Size):
            shape, stride, dtype, _ = item
            parts.append(f"{str(dtype).removeprefix('torch.')}{list(shape)}/{tuple(stride)}")
        else:
            parts.append(repr(item[1]))
    return ", ".join(parts)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ShapeCache(Generic[K, V]):
    """At most ``bound`` entries, the least recently used evicted first.

    A key that comes back after it was evicted shows a working set larger than the bound:
    evicting again would make every such call pay a capture, so :meth:`admits` refuses it
    while the cache is full. The evicted keys are remembered up to ``memory`` of them.
    """

    def __init__(self, bound: int, memory: int | None = None):
        if bound < 1:
            raise ValueError(f"a shape cache holds at least one entry, not {bound}")
        self.bound = bound
        self.memory = 4 * bound if memory is None else memory
        self.entries: OrderedDict[K, V] = OrderedDict()
        self.evicted: OrderedDict[K, None] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The entry under ``key`` (now the most recently used), or None."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def admits(self, key: K) -> bool:
        """Whether :meth:`insert` would take ``key``: room left, or a key never evicted."""
        return len(self.entries) < self.bound or key not in self.evicted

    def insert(self, key: K, entry: V) -> tuple[K, V] | None:
        """Add ``entry`` as the most recently used; returns the (key, entry) evicted for it."""
        if not self.admits(key):
            raise ValueError(f"key {key!r} was evicted before and the cache is full")
        evicted = None
        if len(self.entries) >= self.bound:
            evicted = self.entries.popitem(last=False)
            self.evicted[evicted[0]] = None
            while len(self.evicted) > self.memory:
                self.evicted.popitem(last=False)
        self.evicted.pop(key, None)
        self.entries[key] = entry
        return evicted


@dataclass
class ReplayLog:
    """What a :class:`GraphReplay` did, for the backend's per-graph report."""

    #: the most signatures kept captured (the backend's ``replay_shapes``)
    bound: int
    #: per call signature (see :func:`describe`), what runs for it and why
    shapes: dict[str, str] = field(default_factory=dict)
    #: captures dropped to make room for a new signature (least recently used first)
    evictions: int = 0
    #: calls run plainly because the cache was full and their signature was evicted before
    at_bound: int = 0
    #: calls made during the caller's own CUDA-graph capture (run plainly: no nesting)
    in_capture: int = 0

    def __str__(self) -> str:
        lines = [f"{shape}: {status}" for shape, status in self.shapes.items()]
        lines.append(f"{self.evictions} eviction(s), {self.at_bound} call(s) plain at the bound of "
                     f"{self.bound} shapes, {self.in_capture} call(s) inside the caller's capture")
        return "\n".join(lines)


#: calls per timed loop, and interleaved rounds, when replay is timed against plain calls
TIMING_CALLS, TIMING_ROUNDS = 3, 3
#: plain calls must be faster than replays by this fraction to be chosen (ties: replay)
PLAIN_MARGIN = 0.03


@dataclass
class _Capture:
    """One signature's state: its CUDA graph once captured, or why it runs plainly."""

    description: str
    graph: torch.cuda.CUDAGraph | None = None
    inputs: list[Any] = field(default_factory=list)
    outputs: Any = None
    plain: str | None = None

    def release(self) -> None:
        self.graph, self.inputs, self.outputs = None, [], None


class ShapeBook:
    """The call signatures a :class:`GraphReplay` has seen: the captures kept (a
    :class:`ShapeCache`) and what ran for each (a :class:`ReplayLog`). Needs no GPU.

    A new signature that finds the cache full runs plainly and is only remembered. When it
    comes back before the least recently used capture is used again (it is then the more
    recent of the two), it takes that capture's place. A one-off, such as the last, partial
    batch of each epoch, so never evicts the captures the full batches keep using.
    """

    def __init__(self, bound: int):
        self.cache: ShapeCache[tuple, _Capture] = ShapeCache(bound)
        self.log = ReplayLog(bound)
        self.clock = 0  # lookups so far
        self.used: dict[tuple, int] = {}  # per kept capture, the clock of its last lookup
        #: signatures run plainly at a full cache, with the clock of their last call, up to
        #: ``cache.memory`` of them
        self.waiting: OrderedDict[tuple, int] = OrderedDict()

    def lookup(self, key: tuple) -> tuple[_Capture | None, bool]:
        """The state kept for ``key`` and whether this is its first call (which runs plainly:
        it compiles and tunes; the second captures); ``(None, False)`` when the signature
        runs plainly without a place in the cache: the cache is full and the signature was
        evicted before, or is new or still less recent than every capture kept. One that
        gets a place after waiting has compiled already, and is captured at once."""
        self.clock += 1
        entry = self.cache.get(key)
        if entry is not None:
            self.used[key] = self.clock
            return entry, False
        description = describe(key)
        if not self.cache.admits(key):
            self.log.at_bound += 1
            self._note(description, f"plain: the cache of {self.cache.bound} captured shapes is full "
                                    f"and this shape was evicted before (raise replay_shapes)")
            if self.log.at_bound == 1:
                warnings.warn(f"fxopt backend: more call shapes than replay_shapes={self.cache.bound} keep "
                              f"coming back; shapes beyond the bound run with plain launches", RuntimeWarning,
                              stacklevel=4)
            return None, False
        full = len(self.cache.entries) >= self.cache.bound
        if full:
            last_call = self.waiting.pop(key, None)
            if last_call is None or self.used[next(iter(self.cache.entries))] > last_call:
                self.waiting[key] = self.clock
                while len(self.waiting) > self.cache.memory:
                    self.waiting.popitem(last=False)
                self._note(description, f"plain: the cache of {self.cache.bound} captured shapes is full and "
                                        f"in use; captured if it comes back before the least recently used")
                return None, False
        entry = _Capture(description)
        evicted = self.cache.insert(key, entry)
        self.used[key] = self.clock
        if evicted is not None:
            del self.used[evicted[0]]
            evicted[1].release()
            self.log.evictions += 1
            self._note(evicted[1].description, "evicted (least recently used)")
        if full:  # it ran plainly before, so it has compiled: capture now
            self._note(description, "came back: captured")
            return entry, False
        self._note(description, "first call: plain (compiles); captured at the next call")
        return entry, True

    def _note(self, description: str, status: str) -> None:
        """Log ``status`` for a signature, forgetting the oldest beyond the log's bound."""
        self.log.shapes[description] = status
        while len(self.log.shapes) > self.cache.bound + self.cache.memory:
            del self.log.shapes[next(iter(self.log.shapes))]


class GraphReplay:
    """``compiled`` (a function of CUDA tensors and sizes) run by replaying CUDA graphs of
    it, one per call signature, at most ``max_shapes`` at a time (see the module's doc)."""

    def __init__(self, compiled: Callable, *, max_shapes: int = 8):
        self.compiled = compiled
        self.book = ShapeBook(max_shapes)
        self.log = self.book.log
        self.pool: Any = None  # one memory pool for every capture, made at the first
        self.stream: torch.cuda.Stream | None = None  # where the last replay ran

    def __call__(self, *args: Any) -> Any:
        if torch.cuda.is_current_stream_capturing():
            self.log.in_capture += 1
            return self.compiled(*args)
        key = signature(args)
        if key is None:  # not a call Dynamo makes (it passes tensors and sizes): run as is
            return self.compiled(*args)
        entry, first = self.book.lookup(key)
        if entry is None or first or entry.plain is not None:
            return self.compiled(*args)
        if entry.graph is not None:
            return self._replay(entry, args)
        return self._capture(entry, args)

    def _replay(self, entry: _Capture, args: Sequence[Any]) -> Any:
        stream = torch.cuda.current_stream()
        if stream != self.stream:  # the buffers are shared: no overlap with a replay elsewhere
            if self.stream is not None:
                stream.wait_stream(self.stream)
            self.stream = stream
        for static, arg in zip(entry.inputs, args):
            if isinstance(static, torch.Tensor):
                static.copy_(arg)
        entry.graph.replay()
        return tree_map(_clone, entry.outputs)

    def _capture(self, entry: _Capture, args: Sequence[Any]) -> Any:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.cuda.current_device())
        graph = torch.cuda.CUDAGraph()
        try:
            # what replay reads from: the caller's inputs are never part of the graph (an
            # input whose elements overlap, e.g. expanded, cannot be copied into: plain then)
            entry.inputs = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
                            if isinstance(a, torch.Tensor) else a for a in args]
            with torch.cuda.device(device):
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # CUDA's warm-up before capture
                    self.compiled(*entry.inputs)
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph, pool=self.pool):
                    outputs = self.compiled(*entry.inputs)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run plainly
            self._run_plain(entry, f"capture failed: {type(exc).__name__}: {exc}")
            warnings.warn(f"fxopt backend: a CUDA graph of the compiled function could not be "
                          f"captured ({entry.plain}); this shape runs with plain launches", RuntimeWarning,
                          stacklevel=3)
            return self.compiled(*args)
        entry.graph, entry.outputs = graph, outputs
        replayed, plain = _seconds_per_call((lambda: self._replay(entry, args), lambda: self.compiled(*args)),
                                            device)
        if plain * (1 + PLAIN_MARGIN) < replayed:
            self._run_plain(entry, f"plain launches timed faster ({plain * 1e3:.3f} ms a call, "
                                   f"replayed {replayed * 1e3:.3f} ms)")
            return self.compiled(*args)
        self.log.shapes[entry.description] = (f"replayed ({replayed * 1e3:.3f} ms a call, plain "
                                              f"{plain * 1e3:.3f} ms)")
        return self._replay(entry, args)

    def _run_plain(self, entry: _Capture, why: str) -> None:
        entry.release()
        entry.plain = why
        self.log.shapes[entry.description] = f"plain: {why}"


def _seconds_per_call(calls: Sequence[Callable[[], Any]], device: torch.device | int) -> list[float]:
    """Best wall time per call of back-to-back calls of each of ``calls``, as a caller's
    loop sees it (host and GPU overlap; synchronized at the ends only), in interleaved
    rounds so that a drift of the machine hits each alike."""
    best = [float("inf")] * len(calls)
    for _ in range(TIMING_ROUNDS):
        for index, call in enumerate(calls):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(TIMING_CALLS):
                call()
            torch.cuda.synchronize(device)
            best[index] = min(best[index], (time.perf_counter() - start) / TIMING_CALLS)
    return best


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
