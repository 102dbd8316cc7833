"""Peak memory of one call, measured the way ``bench/memory.py`` reports it.

On CUDA the caching allocator keeps the statistic (``max_memory_allocated``). On CPU
nothing does, so :func:`cpu_peak` samples glibc's ``mallinfo2`` (bytes handed out by
malloc, mmapped chunks included) after every ATen op through a ``TorchDispatchMode``:
it sees every tensor an op returns and every Python-side allocation that goes through
malloc, but not temporaries freed inside one op. Both report bytes above what was in
use before the call (parameters, inputs, an arena allocated beforehand).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2]:
    """glibc's ``mallinfo2``, loaded on first use (glibc 2.33+; Linux only)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not taken back (heap chunks plus mmapped ones)."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


class _PeakSampler(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.peak = malloc_in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, malloc_in_use())
        return out


def cpu_peak(fn: Callable[[], Any]) -> int:
    """The most malloc'd bytes above the starting point while ``fn()`` runs (after one warm-up
    call: lazy initializations allocate once), sampled after every ATen op."""
    fn()
    base = malloc_in_use()
    with torch.no_grad(), _PeakSampler() as sampler:
        out = fn()
    del out
    return sampler.peak - base


def cuda_peak(fn: Callable[[], Any]) -> int:
    """The most CUDA bytes allocated above the starting point while ``fn()`` runs (after one
    warm-up call)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base
