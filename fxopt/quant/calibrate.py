"""Calibration: run representative data through an observed GraphModule.

The observers that ``insert_observers`` placed record ranges as the data flows; nothing
else changes. A progress bar (:mod:`fxopt.progress`) shows on long runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from fxopt.errors import InputError
from fxopt.progress import progress as progress_bar
from fxopt.quant.observers import Observer

#: batches from which a progress bar is shown when ``progress`` is left to decide
PROGRESS_MIN_BATCHES = 16


def calibrate(gm: fx.GraphModule, data: Iterable[Any], *, progress: bool | None = None) -> int:
    """Run every batch of ``data`` through ``gm`` (eval mode, no grad); return the count.

    A batch is a tuple of positional inputs or a single tensor. ``progress=None`` shows a
    bar for runs of at least :data:`PROGRESS_MIN_BATCHES` batches (or of unknown length)
    when stderr is a terminal; ``True`` always, ``False`` never.
    Raises :class:`fxopt.InputError` if ``gm`` has no observers or ``data`` is empty.
    """
    observers = [m for m in gm.modules() if isinstance(m, Observer)]
    if not observers:
        raise InputError("calibrate: the GraphModule has no observers; run the insert_observers "
                         "pass first (fxopt.optimize(gm, ['insert_observers'], example_inputs=...))")
    total = len(data) if hasattr(data, "__len__") else None
    if total == 0:
        raise InputError("calibrate: no calibration data (the iterable is empty); pass at least "
                         "one batch of representative inputs")
    if progress is None and total is not None and total < PROGRESS_MIN_BATCHES:
        progress = False  # short runs stay silent; long ones show where stderr is a terminal
    was_training = gm.training
    gm.eval()
    count = 0
    try:
        with torch.no_grad():
            for batch in progress_bar(data, total=total, desc="calibrating", unit="batch", enabled=progress):
                gm(*batch) if isinstance(batch, (tuple, list)) else gm(batch)
                count += 1
    finally:
        gm.train(was_training)
    if count == 0:
        raise InputError("calibrate: no calibration data (the iterable yielded nothing)")
    return count
