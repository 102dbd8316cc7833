"""The flags every bench shares, so that ``--smoke`` and ``--out`` mean one thing everywhere."""

from __future__ import annotations

import argparse


def parser(doc: str | None, rounds: int = 3) -> argparse.ArgumentParser:
    """An argument parser with the shared flags; the bench adds its own.

    ``--smoke``: tiny shapes on the CPU, a few seconds, what CI runs so that no bench rots.
    ``--out``: the JSON file (default ``bench/results/<gpu>/<bench>.json``, see
    :func:`harness.records.results_dir`). ``--rounds``: interleaved timing rounds.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the bench's logic (CI)")
    p.add_argument("--out", default=None, help="JSON file of the run (default bench/results/<gpu>/<bench>.json)")
    p.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
    return p


def device_for(args: argparse.Namespace, default: str = "cuda") -> str:
    """``cpu`` under ``--smoke``; else the bench's ``--device`` flag if it has one, else ``default``."""
    if args.smoke:
        return "cpu"
    return getattr(args, "device", None) or default
