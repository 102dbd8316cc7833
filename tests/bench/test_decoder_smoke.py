"""bench/decoder.py --smoke runs on a CPU and measures what its columns say.

Every compiled variant is Dynamo with its eager backend there, so a bf16 variant runs the
very ops of the uncompiled bf16 reference: its greedy tokens must agree at every position.
A disagreement would mean the bench's decode loop (positions, cache per batch size, the
compiled and uncompiled calls sharing one cache) is wrong, not the model.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "decoder.py"


def smoke(tmp_path: pathlib.Path, variants: str, *extra: str) -> dict:
    subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path), "--variants", variants, *extra],
                   check=True, capture_output=True, timeout=600)
    return json.loads((tmp_path / "decoder.json").read_text())


def test_smoke_measures_every_variant_or_says_why(tmp_path):
    result = smoke(tmp_path, "bf16 reduce-overhead freezing,fxopt int8 backend,torchao int4")
    rows = result["variants"]
    assert list(rows) == ["bf16 reduce-overhead freezing", "fxopt int8 backend", "torchao int4"]
    shapes = {f"decode_b{b}" for b in result["batches"]} | {f"prefill_{n}" for n in result["prefill"]}
    for name in ("bf16 reduce-overhead freezing", "fxopt int8 backend"):
        row = rows[name]
        assert "error" not in row, row.get("error")
        assert set(row["first_call_s"]) == shapes
        assert all(v > 0 for v in row["tokens_per_s"].values()) and len(row["tokens_per_s"]) == 2
        assert set(row["prefill_ms"]) == {str(n) for n in result["prefill"]}
        assert row["graphs"] == len(shapes)  # one per shape: no recompile per decode position
    bf16 = rows["bf16 reduce-overhead freezing"]
    assert all(a == {"prefix": 1.0, "overall": 1.0} for a in bf16["agreement"].values())
    # every linear layer quantized: 5 per block (wqkv, wo, w1, w3, w2) and the output head
    assert rows["fxopt int8 backend"]["quantized"] == {"parts": 2 * 3 + 1, "sites": 2 * 5 + 1, "min_coverage": 1.0}
    assert rows["torchao int4"]["error"].startswith("skipped")
    assert result["speedups"]["bf16 reduce-overhead freezing"] == {
        "decode_b1": 1.0, "decode_b2": 1.0, "prefill_16": 1.0, "prefill_32": 1.0}


def test_fresh_runs_each_variant_in_its_own_process(tmp_path):
    """--fresh: the row comes back from a child process, as complete as in one process."""
    rows = smoke(tmp_path, "bf16 default", "--fresh")["variants"]
    assert "error" not in rows["bf16 default"], rows["bf16 default"].get("error")
    assert all(a["prefix"] == 1.0 for a in rows["bf16 default"]["agreement"].values())


def bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("decoder_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)  # a script: it puts the repository and bench/ on sys.path
    finally:
        sys.path[:] = path
    return module


def test_agreement_counts_positions_before_the_first_divergence():
    import torch

    reference = torch.arange(16).view(2, 8)
    tokens = reference.clone()
    tokens[0, 3] = -1  # row 0 diverges at step 3 and agrees again later: prefix 3/8, overall 7/8
    assert bench_module().agreement(tokens, reference) == {"prefix": (3 / 8 + 1) / 2, "overall": 15 / 16}


def test_speedups_are_against_the_best_bf16_mode_of_each_figure():
    """tokens/s: the highest bf16 figure is the baseline; prefill ms: the lowest. A failed
    bf16 mode is no baseline."""
    rows = {
        "bf16 default": {"tokens_per_s": {"b1": 100.0}, "prefill_ms": {"512": 10.0}},
        "bf16 reduce-overhead": {"tokens_per_s": {"b1": 200.0}, "prefill_ms": {"512": 20.0}},
        "bf16 freezing": {"error": "Traceback ..."},
        "fxopt int8": {"tokens_per_s": {"b1": 300.0}, "prefill_ms": {"512": 8.0}},
    }
    got = bench_module().speedups(rows)
    assert got["fxopt int8"] == {"decode_b1": 1.5, "prefill_512": 1.25}
    assert got["bf16 default"] == {"decode_b1": 0.5, "prefill_512": 1.0}
    assert "bf16 freezing" not in got
