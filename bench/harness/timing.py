"""Timing, one way for every bench: medians of CUDA events on a GPU, the wall clock on a CPU.

``call_ms`` is the figure the zoo and the serving benches compare (a call as the user makes
it); ``loop_ms`` times calls back to back (what a launch-bound loop pays); ``host_ms`` the
CPU's share alone. ``alternate`` interleaves the variants' rounds so that a machine that
drifts (clocks, other tenants) moves every variant alike; ``fresh_process`` runs a variant in
a process of its own where one process's state (allocator, caches, CUDA graphs) would leak
into the next variant's figure; ``clocked`` times one host-side run (an ``optimize``, a
rewrite, a report) on the wall clock and in CPU seconds.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

K = TypeVar("K")
V = TypeVar("V")


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def call_ms(fn: Callable[[], Any], device: str, graph: bool = False, warmup: int = 25, reps: int = 100) -> float:
    """Median ms of one call of ``fn``.

    On a GPU: ``triton.testing.do_bench`` (CUDA events around each call, the L2 cache cleared
    between calls, the median), on the Python call as launched or (``graph``) on one
    CUDA-graph replay of it, which takes the CPU's launch overhead out and leaves the GPU's
    work. On a CPU: the wall clock around each of a few calls.
    """
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench

        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return do_bench(g.replay, warmup=warmup, rep=reps, return_mode="median")
        return do_bench(fn, warmup=warmup, rep=reps, return_mode="median")
    times = []
    for _ in range(max(3, min(reps, 5))):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def loop_ms(fn: Callable[[], Any], device: str, iters: int = 20, reps: int = 5, warmup: int = 3,
            host: bool = False) -> float:
    """Median over ``reps`` of the ms per call of ``iters`` calls back to back (host launch
    cost included: a call the CPU cannot issue as fast as the GPU runs it shows here).
    CUDA events around the loop on a GPU, the wall clock on a CPU; ``host``: the wall clock
    stopped before the device finishes, i.e. the CPU's cost of issuing the calls."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if cuda and not host:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            sync(device)
            began = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - began) * 1e3 / iters)
            sync(device)
    return median(samples)


def wall_ms(fn: Callable[[], Any], device: str, reps: int = 20, warmup: int = 3) -> float:
    """Median ms of one call from start to the device's end (synchronized wall clock): what
    a caller waits, host and device together; the figure a per-node profile should add up to."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def host_ms(fn: Callable[[], Any], device: str, reps: int = 15) -> float:
    """Median host ms of one call started on an idle device: the CPU's cost of launching it
    (Python, guards, dispatch, launches), which plain launches pay when it exceeds the GPU's work."""
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    sync(device)
    return median(times)


class Clocked(NamedTuple):
    """One call: its wall seconds, the CPU seconds it cost, and what it returned."""

    wall_s: float
    cpu_s: float
    value: Any


def clocked(fn: Callable[[], Any]) -> Clocked:
    """Wall and CPU seconds of one call of ``fn`` on the host, and its result: what the CPU-side
    benches (passes, rewrites, the report) time, one run being seconds of work.

    CPU seconds are this process's and those of the children it waited for (a renderer it
    ran): on a shared, loaded machine they are the steadier figure, since other tenants
    stretch the wall clock and not the work done. Garbage is collected first, so that a run
    does not pay for what an earlier run left behind.
    """
    gc.collect()
    children = _children_cpu_s()
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Clocked(wall, cpu + _children_cpu_s() - children, value)


def _children_cpu_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


def alternate(variants: Mapping[K, V], rounds: int, measure: Callable[[V], float],
              on_error: Callable[[K, BaseException], None] | None = None,
              reverse_odd: bool = False) -> dict[K, list[float]]:
    """``measure(value)`` of every variant, round after round (A B C, A B C, ...; with
    ``reverse_odd`` A B C, C B A, ..., so that no variant always runs right after another):
    each variant's samples, sorted. A value is what ``measure`` takes: a callable, or a name. A variant that raises leaves the race (``on_error`` hears why; without
    it the error propagates)."""
    live = dict(variants)
    samples: dict[K, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(live.items())
        for name, fn in (order[::-1] if reverse_odd and r % 2 else order):
            try:
                samples[name].append(measure(fn))
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(name, exc)
                del live[name]
    return {name: sorted(times) for name, times in samples.items() if times}


def fresh_process(script: str | Path, argv: Sequence[str], timeout: float,
                  env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``python script *argv --out FILE`` in a new process (``env`` added to this one's
    environment) and return the JSON it wrote there, with ``process_s``; a failure is
    ``{"error": why}``, never an exception, so one variant that dies costs the run only its
    own row (``timeout`` may be infinite). A child killed at ``timeout`` returns what it had written (a :class:`Record` is
    rewritten on every row) with the error."""
    with tempfile.TemporaryDirectory(prefix="fxopt_bench_") as folder:
        path = Path(folder) / "child.json"
        began = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, str(script), *argv, "--out", str(path)],
                                  capture_output=True, text=True, timeout=timeout if math.isfinite(timeout) else None,
                                  env={**os.environ, **env} if env else None)
        except subprocess.TimeoutExpired:
            partial = json.loads(path.read_text()) if path.exists() else {}
            return {**partial, "error": f"no result within {timeout:.0f} s"}
        if done.returncode != 0 or not path.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {done.returncode}: {' | '.join(tail)}"[:600]}
        row = json.loads(path.read_text())
        row["process_s"] = time.perf_counter() - began
        return row
