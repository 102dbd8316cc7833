"""The JSON record of a run and the markdown table printed from it.

One layout for every bench (``meta``: the environment and the arguments; ``rows``: one dict
per measured thing; ``elapsed_s``), so a reader, a test or RESULTS.md finds the same fields
in each. The file is rewritten on every ``save()``: a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from harness.env import environment, slug

#: bench/results/: raw files, one folder per GPU kind (``cpu`` for CPU runs)
RESULTS = Path(__file__).resolve().parents[1] / "results"


def results_dir(device_name: str, gpus: int = 1) -> Path:
    """``bench/results/<gpu>/``, ``<gpu>x<n>`` for a run over ``n`` GPUs (``h200x2``)."""
    name = slug(device_name)
    return RESULTS / (f"{name}x{gpus}" if gpus > 1 and name != "cpu" else name)


class Record:
    """The run of bench ``name``: ``meta`` (environment, arguments), ``rows``, written to
    ``args.out`` (a file, or a folder to put ``<name>.json`` in) or to
    ``bench/results/<gpu>/<name>.json`` (``<name>_smoke.json`` under ``--smoke``)."""

    def __init__(self, name: str, args: argparse.Namespace | None, device: str, gpus: int = 1,
                 **meta: Any):
        self.started = time.perf_counter()
        arguments = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))} \
            if args is not None else {}
        self.meta: dict[str, Any] = {"bench": name, **environment(device), "args": arguments, **meta}
        if gpus > 1:
            self.meta["gpus_used"] = gpus
        out = getattr(args, "out", None)
        smoke = bool(getattr(args, "smoke", False))
        # --out names the file; a folder (as some benches once took) gets <name>.json; the
        # results folder keeps a smoke run apart from a real one
        if out:
            self.path = Path(out) / f"{name}.json" if Path(out).is_dir() else Path(out)
        else:
            self.path = results_dir(self.meta["device"], gpus) / (f"{name}_smoke.json" if smoke else f"{name}.json")
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}

    def add(self, row: dict[str, Any], save: bool = True) -> dict[str, Any]:
        """Append ``row`` (and rewrite the file): returns the row, to fill in further."""
        self.rows.append(row)
        if save:
            self.save()
        return row

    @property
    def data(self) -> dict[str, Any]:
        return {"meta": self.meta, "rows": self.rows, **self.extra,
                "elapsed_s": round(time.perf_counter() - self.started, 3)}

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        return self.path


def markdown_table(rows: Iterable[dict[str, Any]], columns: Sequence[str], digits: int = 3) -> str:
    """A markdown table of ``columns`` (missing cells ``-``, floats to ``digits`` places)."""
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.{digits}f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
