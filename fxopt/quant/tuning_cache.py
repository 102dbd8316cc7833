"""On-disk cache of the int8 weight-only kernels' tuning results.

Tuning, when asked for (``FXOPT_INT8_TUNE=1``, :mod:`fxopt.quant.int8_configs`), times
every candidate kernel configuration once per (M bucket, N, K, dtype) on the first call:
45-60 s per M bucket for a Llama-sized stack on an H100 (bench/RESULTS.md). The winner
depends only on the machine and the software, so it is kept in a JSON file and a later
process on the same machine starts from it, before any shipped default. An entry's key holds the GPU's name,
the Triton and torch versions and the tuning key; anything else (another GPU, a Triton
upgrade) misses and tunes afresh. The file lives in ``$FXOPT_CACHE_DIR`` (default
``~/.cache/fxopt``); an unreadable or corrupt file counts as empty, and writes replace
it atomically, so concurrent processes at worst tune twice.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

FILE_NAME = "int8_tuning.json"


def cache_path() -> Path:
    """Where the cache file is: ``$FXOPT_CACHE_DIR/int8_tuning.json`` or under ``~/.cache/fxopt``."""
    root = os.environ.get("FXOPT_CACHE_DIR") or Path.home() / ".cache" / "fxopt"
    return Path(root) / FILE_NAME


def entry_key(machine: str, tuning_key: tuple) -> str:
    """One entry's key: the machine/software string and the tuning key, as text."""
    return f"{machine}|" + "|".join(str(part) for part in tuning_key)


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lookup(key: str) -> tuple[str, dict[str, int]] | None:
    """The cached (kernel, configuration fields) for ``key``, or None."""
    value = _read().get(key)
    if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], dict)):
        return value[0], value[1]
    return None


def store(key: str, kernel: str, config: dict[str, int]) -> None:
    """Record ``key``'s winner. A cache that cannot be written is skipped: it only saves time."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read()
        data[key] = [kernel, config]
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(f.name, path)
    except OSError:
        return
