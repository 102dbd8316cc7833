"""One lock per fake mode, for the code that runs ops under a mode other threads may share.

A ``FakeTensorMode`` keeps per-mode state while ops run under it (the kernel-invocation
flag, the real-to-fake converter's memo, its shape environment's guards), so it must not
run in two threads at once: graphs whose ``meta['val']`` share one mode (a capture copied
for several threads, one graph optimized by several) would otherwise trip over each other.
Shape propagation (:mod:`fxopt.analysis.shapes`) and the values of rewritten nodes
(:mod:`fxopt.patterns.meta`) run under :func:`fake_mode_lock` of their mode; fresh modes
are private to one call, so their locks are never contended.
"""

from __future__ import annotations

import threading
import weakref

from torch._subclasses.fake_tensor import FakeTensorMode

_LOCKS: weakref.WeakKeyDictionary[FakeTensorMode, threading.RLock] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def fake_mode_lock(mode: FakeTensorMode) -> threading.RLock:
    """The lock of ``mode`` (reentrant: propagation may nest in one thread)."""
    with _GUARD:
        lock = _LOCKS.get(mode)
        if lock is None:
            lock = _LOCKS[mode] = threading.RLock()
        return lock
