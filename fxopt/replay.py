"""Replay a compiled inference graph as a CUDA graph, invisibly to the caller.

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
  inference graph on CUDA tensors of static shapes, whose every op the op-facts model
  knows (no random draws, no collectives, no state updates, no unknown ops), that writes
  none of its inputs (writes into its own intermediates replay alike), and whose outputs share no storage with its inputs or with each other.
  Anything else runs the compiled function as is;
* a call that does not match the captured one (other shapes, strides, dtypes or
  devices), or one made while the caller captures a CUDA graph of their own, runs the
  compiled function as is.

The first call runs the compiled function (it compiles and tunes kernels); the second
captures, after one warm-up on a side stream as CUDA requires, then times a few replays
against a few plain calls and keeps replaying only if that is faster: a GPU-bound graph
gains nothing from a replay and still pays for the input copies and output clones (a
Llama-shaped decoder on an H100 ran 5% slower replayed, bench/RESULTS.md). The price is
the graph's private memory pool, held as long as the compiled function lives.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxopt.analysis import ops
from fxopt.analysis.alias import storages_of

__all__ = ["GraphReplay", "refusal"]


def refusal(gm: fx.GraphModule, example_inputs: Sequence[Any], *, training: bool) -> str | None:
    """Why replaying ``gm`` as a CUDA graph could differ from running it (None: it cannot).

    ``gm`` is the torch-level graph handed to Inductor, with Dynamo's example values in
    ``meta['val']``; ``example_inputs`` are the inputs the compiled function takes.
    """
    if training:
        return "a training graph (autograd records the call)"
    for index, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor):
            return f"input {index} is not a tensor ({type(value).__name__})"
        if value.device.type != "cuda":
            return f"input {index} is on {value.device}"
    placeholders = set(gm.graph.find_nodes(op="placeholder"))
    inputs = set().union(*(storages_of(_value(n)) for n in placeholders))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        facts = ops.facts(node)
        if facts.random or facts.collective or facts.stateful or facts.unknown:
            return f"node {node.name} is not known to be pure ({facts.reason or 'effects'})"
        for written in facts.writes:  # a write into the graph's own tensors replays alike
            if storages_of(_value(written)) & inputs or _value(written) is None:
                return f"node {node.name} writes input {written.name}"
        for leaf in tree_flatten(_value(node))[0]:
            if isinstance(leaf, torch.SymInt | torch.SymFloat | torch.SymBool):
                return f"node {node.name} has a symbolic value (dynamic shapes)"
            if isinstance(leaf, torch.Tensor) and any(not isinstance(s, int) for s in leaf.shape):
                return f"node {node.name} has a dynamic shape"
    seen: set = set()
    for index, out in enumerate(tree_flatten(gm.graph.output_node().args[0])[0]):
        value = _value(out) if isinstance(out, fx.Node) else out
        if not isinstance(value, torch.Tensor) or value.device.type != "cuda":
            return f"output {index} is not a CUDA tensor"
        storages = storages_of(value)
        if storages & inputs:
            return f"output {index} shares storage with an input"
        if storages & seen:
            return f"output {index} shares storage with another output"
        seen |= storages
    return None


def _value(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def _signature(args: Sequence[Any]) -> tuple:
    return tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)


#: calls per timed loop, and loops, when replay is timed against plain calls at capture
TIMING_CALLS, TIMING_LOOPS = 3, 2


class GraphReplay:
    """``compiled`` (a function of CUDA tensors) run by replaying a CUDA graph of it.

    ``given_up`` is told why, if replay is given up at run time (a failed capture, or
    plain calls timed faster), so that the backend's report says what really runs.
    """

    def __init__(self, compiled: Callable, example_inputs: Sequence[torch.Tensor],
                 given_up: Callable[[str], None] | None = None):
        self.compiled = compiled
        self.given_up = given_up
        self.signature = _signature(example_inputs)
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: Any = None
        #: why replay was given up at run time (None while it is on)
        self.failure: str | None = None

    def __call__(self, *args: Any) -> Any:
        if (self.failure is not None or torch.cuda.is_current_stream_capturing()
                or _signature(args) != self.signature):
            return self.compiled(*args)
        if self.graph is None:
            self.calls += 1
            if self.calls == 1:
                return self.compiled(*args)
            return self._capture(args)
        return self._replay(args)

    def _replay(self, args: Sequence[torch.Tensor]) -> Any:
        for static, arg in zip(self.static_inputs, args):
            static.copy_(arg)
        self.graph.replay()
        return tree_map(_clone, self.static_outputs)

    def _capture(self, args: Sequence[torch.Tensor]) -> Any:
        # what replay reads from: the caller's inputs are never part of the graph
        self.static_inputs = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                              for a in args]
        for static, arg in zip(self.static_inputs, args):
            static.copy_(arg)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(args[0].device if args else torch.cuda.current_device()):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # CUDA's warm-up before capture
                    self.compiled(*self.static_inputs)
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    outputs = self.compiled(*self.static_inputs)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run plainly
            self._give_up(f"capture failed: {type(exc).__name__}: {exc}")
            warnings.warn(f"fxopt backend: a CUDA graph of the compiled function could not be "
                          f"captured ({self.failure}); it runs with plain launches", RuntimeWarning,
                          stacklevel=3)
            return self.compiled(*args)
        self.graph, self.static_outputs = graph, outputs
        device = args[0].device if args else torch.cuda.current_device()
        replayed = _seconds_per_call(lambda: self._replay(args), device)
        plain = _seconds_per_call(lambda: self.compiled(*args), device)
        if plain <= replayed:
            self._give_up(f"plain launches timed faster ({plain * 1e3:.3f} ms a call, "
                          f"replayed {replayed * 1e3:.3f} ms)")
            return self.compiled(*args)
        return self._replay(args)

    def _give_up(self, why: str) -> None:
        self.failure = why
        self.graph, self.static_inputs, self.static_outputs = None, [], None
        if self.given_up is not None:
            self.given_up(why)


def _seconds_per_call(call: Callable[[], Any], device: torch.device | int) -> float:
    """Best wall time per call of back-to-back calls, as a caller's loop sees it (host and
    GPU overlap; synchronized at the ends only)."""
    best = float("inf")
    for _ in range(TIMING_LOOPS):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(TIMING_CALLS):
            call()
        torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / TIMING_CALLS)
    return best


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
