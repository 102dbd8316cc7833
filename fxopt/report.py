"""The report of an optimize run: one record per pass, nested for pipelines."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fxopt.snapshot import GraphSnapshot


@dataclass
class PassRecord:
    """What happened when one pass (or one composite pipeline) ran."""

    name: str
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    changed: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    #: rounds a fixpoint ran; None for other passes
    rounds: int | None = None
    #: why the pass did not run (e.g. inference-only pass on a training graph)
    skipped: str | None = None
    warnings: list[str] = field(default_factory=list)
    children: list[PassRecord] = field(default_factory=list)
    #: the graph before this pass, kept when the pass changed it (for diffs; the graph
    #: after it is the next changing pass's ``before``, or the result)
    before: GraphSnapshot | None = None

    def walk(self, depth: int = 0) -> Iterator[tuple[int, PassRecord]]:
        yield depth, self
        for child in self.children:
            yield from child.walk(depth + 1)


@dataclass
class Report:
    """Per-pass records of a run. Reach it with ``fxopt.report_of(gm)``."""

    records: list[PassRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    verified: bool = False
    #: the measured before/after (a ProfileDiff) when optimize ran with profile=fxopt.profile
    profile: Any = None

    def walk(self) -> Iterator[tuple[int, PassRecord]]:
        for record in self.records:
            yield from record.walk()

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def find(self, name: str) -> list[PassRecord]:
        """Every record of the pass called ``name``, in the order they ran."""
        return [r for _, r in self.walk() if r.name == name]

    def table(self, width: int = 100) -> str:
        """The per-pass table that the CLI and the demo print, its notes wrapped to ``width``."""
        rows = []
        for depth, r in self.walk():
            note = r.skipped or (f"{r.rounds} rounds" if r.rounds is not None else "")
            note = "; ".join(filter(None, [note, *r.warnings, _format_stats(r.stats)]))
            rows.append([
                "  " * depth + r.name,
                f"{r.seconds * 1e3:.1f}",
                r.nodes_before,
                r.nodes_after,
                "skipped" if r.skipped else ("yes" if r.changed else "no"),
                note,
            ])
        headers = ["pass", "ms", "nodes before", "nodes after", "changed", "notes"]
        fixed = sum(max(len(str(v)) for v in column) + 2 for column in zip(headers, *rows) if column[0] != "notes")
        from tabulate import tabulate  # on first use: ``import fxopt`` stays free of it

        text = tabulate(rows, headers=headers, maxcolwidths=[None] * 5 + [max(20, width - fixed)])
        footer = [f"total {self.total_seconds * 1e3:.1f} ms" + (", verified after each pass" if self.verified else "")]
        footer += textwrap.wrap("; ".join(f"warning: {w}" for w in self.warnings), width)
        return text + "\n" + "\n".join(footer)

    def __str__(self) -> str:
        return self.table()


def _format_stats(stats: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in stats.items() if isinstance(v, (int, float, str, bool)))
