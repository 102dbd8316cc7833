"""Progress bars for work a person waits on: one helper, so every bar behaves the same.

Bars are tqdm's, on stderr (stdout stays clean for tables and pipes), and shown only when
someone can see them: stderr is a terminal, nobody switched them off, and the caller did
not pass ``enabled=False``. ``enabled=True`` forces one even into a file or pipe.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

_default: bool | None = None


def set_progress(enabled: bool | None) -> None:
    """Switch every bar off (False, what ``fxopt --quiet`` does) or on (True) for this
    process; None restores the default, which is "when stderr is a terminal"."""
    global _default
    _default = enabled


def progress(iterable: Iterable[Any] | None = None, *, desc: str, total: int | None = None,
             unit: str = "it", enabled: bool | None = None, delay: float = 0.0) -> tqdm:
    """A tqdm bar over ``iterable`` (or updated by hand), shown as the module doc says.

    ``delay`` seconds pass before it appears, so that work which turns out short stays
    silent; the bar is removed when done (``leave=False``), leaving only the result.
    """
    if enabled is None:
        enabled = _default if _default is not None else _is_terminal(sys.stderr)
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=not enabled,
                file=sys.stderr, delay=delay, leave=False, dynamic_ncols=True)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False
