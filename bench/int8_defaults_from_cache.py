"""Merge an int8 tuning cache into the shipped table of default configurations.

    python3 bench/int8_defaults_from_cache.py CACHE_JSON --family sm90 [--table PATH]

CACHE_JSON is a file that ``fxopt.quant.tuning_cache`` wrote (``int8_tuning.json``: keys
``"{gpu name}|triton X|torch Y|{m bucket}|{N}|{K}|{dtype}|{has bias}|{kind}|{gated}"``,
values ``[kernel, {config fields}]``), for instance from a tuning run on a GPU with
``FXOPT_INT8_TUNE=1 FXOPT_CACHE_DIR=...``. Each entry becomes ``"{family}|{tuning key}"``
in the table (default: the package's ``fxopt/quant/int8_defaults.json``): the GPU name and
software versions are dropped, since the table serves every SKU of the family and every
version (an entry whose configuration is no longer a candidate is ignored at run time).
Existing entries of other shapes are kept, those of the same shape replaced, and a line
naming the source is added to the table's ``_source`` list. ``--family`` is the compute
capability of the GPU that tuned (``torch.cuda.get_device_capability``: H100 and H200 are
``sm90``); it is not derived from the name, which varies between SKUs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parent.parent / "fxopt" / "quant" / "int8_defaults.json"
#: fields of a tuning key after the machine part: M bucket, N, K, dtype, bias, kind, gated
KEY_FIELDS = 7


def split_key(key: str) -> tuple[str, str, str, list[str]]:
    """(GPU name, "triton X", "torch Y", tuning key fields) of a cache key; ValueError if it
    is not one (the GPU name is the only part that may hold a "|")."""
    parts = key.split("|")
    if len(parts) < KEY_FIELDS + 3:
        raise ValueError(f"not a tuning cache key: {key!r}")
    triton, torch = parts[-KEY_FIELDS - 2], parts[-KEY_FIELDS - 1]
    if not (triton.startswith("triton ") and torch.startswith("torch ")):
        raise ValueError(f"not a tuning cache key: {key!r}")
    return "|".join(parts[:-KEY_FIELDS - 2]), triton, torch, parts[-KEY_FIELDS:]


def table_entries(cache: dict[str, Any], family: str) -> tuple[dict[str, list], set[str]]:
    """The table entries of every well-formed cache entry, and the machines they came from
    ("name, triton X, torch Y"). Two machines' winners for one shape: the later key's."""
    entries, machines = {}, set()
    for key in sorted(cache):
        value = cache[key]
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
                and isinstance(value[1], dict)):
            print(f"skipped (not [kernel, fields]): {key}", file=sys.stderr)
            continue
        gpu, triton, torch, fields = split_key(key)
        entries["|".join([family, *fields])] = [value[0], value[1]]
        machines.add(f"{gpu}, {triton}, {torch}")
    return entries, machines


def merge(table: dict[str, Any], entries: dict[str, list], note: str) -> dict[str, Any]:
    """``table`` with ``entries`` added or replacing those of the same key, and ``note``
    appended to its ``_source`` list."""
    merged = {**table, **entries}
    merged["_source"] = [*table.get("_source", []), note]
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cache", type=Path, help="an int8_tuning.json written by fxopt")
    parser.add_argument("--family", required=True,
                        help='compute capability of the GPU that tuned, e.g. "sm90" (H100, H200)')
    parser.add_argument("--table", type=Path, default=TABLE, help=f"the table to merge into ({TABLE})")
    args = parser.parse_args(argv)
    entries, machines = table_entries(json.loads(args.cache.read_text()), args.family)
    table = json.loads(args.table.read_text()) if args.table.exists() else {}
    replaced = sum(key in table for key in entries)
    note = (f"{args.family}: {len(entries)} entries from a tuning cache ({args.cache.name}) of "
            f"{'; '.join(sorted(machines)) or 'no machine'}")
    args.table.write_text(json.dumps(merge(table, entries, note), indent=1, sort_keys=True) + "\n")
    print(f"{args.table}: {len(entries) - replaced} entries added, {replaced} replaced ({note})")


if __name__ == "__main__":
    main()
