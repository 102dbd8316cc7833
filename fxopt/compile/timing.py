"""GPU timing for the choices fxopt makes by measurement (a GEMM kernel, a convolution's
form): the device's time for a piece of work, not the host's time to launch it.

A choice is made while a graph compiles, often while Inductor's compile workers keep the
host busy. Timed as the events around each launch, a form made of several eager ops is then
charged the host's gaps between its kernels, which in the compiled model are gone (Inductor
fuses the ops, and the CUDA-graph replay launches them all at once). :func:`time_ms` keeps
the host out with a sleep on the GPU; :func:`replay_time_ms` goes further for multi-op
forms and times a CUDA-graph replay of one launch, which the host issues as one call.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from typing import Any

import torch

#: GPU cycles to sleep per timed run before the batch: ~100 us at H100 clocks, more than the
#: host needs to enqueue one run (a Triton launch, a compiled function's guards), so the
#: events time the GPU alone
_SLEEP_CYCLES_PER_RUN = 200_000


def time_ms(launch: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median GPU time of ``launch()`` in ms, over ``reps`` runs after one warm-up (which
    compiles). The stream first sleeps on the GPU while the host enqueues every run, so a
    launcher slower on the host (Triton's Python launcher against cuBLAS's) is not charged
    for it: in a model the GPU is busy with earlier work while the host launches."""
    launch()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda._sleep(_SLEEP_CYCLES_PER_RUN * reps)
    for start, end in events:
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def replay_time_ms(launch: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median GPU time of ``launch()`` in ms, captured once into a CUDA graph and timed as
    its replays (:func:`time_ms`): however many ops ``launch`` runs, and however slow the
    host is, the replay issues them back to back. The warm-up runs on a side stream before
    the capture (cuDNN plans its kernels, the allocator settles), as ``torch.cuda.graphs``
    asks; the capture is thread-local, so other threads' CUDA calls are not refused while
    it lasts."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        launch()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        launch()
    return time_ms(graph.replay, device, reps)


Timer = Callable[[Callable[[], Any], torch.device, int], float]


class Choices:
    """Choices made by timing, each the first time its key is asked, kept for the process.

    A key names what the choice holds for (the GPU by name, so that it holds for every GPU of
    the kind, and the shapes); the candidates are timed in alternating rounds and each keeps
    its best round, so that a drift of the GPU's clock while a graph compiles hits all alike.
    Thread-safe: a racing thread's choice stands, and nothing process-wide is changed."""

    def __init__(self) -> None:
        self._made: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def made(self) -> dict[tuple, str]:
        """Every choice made so far, by key: a copy."""
        with self._lock:
            return dict(self._made)

    def choose(self, key: tuple, candidates: dict[str, Callable[[], Any]], device: torch.device,
               timer: Timer = replay_time_ms, reps: int = 10, rounds: int = 3) -> str:
        """The name of the fastest candidate for ``key`` (the first named wins a tie)."""
        with self._lock:
            known = self._made.get(key)
        if known is not None:
            return known
        best = {name: float("inf") for name in candidates}
        for _ in range(rounds):
            for name, launch in candidates.items():
                best[name] = min(best[name], timer(launch, device, reps))
        fastest = min(best, key=best.__getitem__)
        with self._lock:
            return self._made.setdefault(key, fastest)
