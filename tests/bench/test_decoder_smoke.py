"""bench/decoder.py: the parts its ``--smoke`` run in tests/bench/test_smoke.py leaves out.

That run checks that a bf16 variant, compiled by Dynamo with its eager backend on a CPU,
runs the very ops of the uncompiled bf16 reference: its greedy tokens agree at every
position. A disagreement would mean the bench's decode loop (positions, cache per batch
size, the compiled and uncompiled calls sharing one cache) is wrong, not the model.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def decoder(bench_script):
    return bench_script("decoder")


def test_fresh_runs_each_variant_in_its_own_process(decoder, tmp_path):
    """--fresh: the row comes back from a child process, as complete as in one process."""
    data = decoder.main(["--smoke", "--fresh", "--variants", "bf16 default", "--out", str(tmp_path / "d.json")])
    (row,) = data["rows"]
    assert row["variant"] == "bf16 default" and "error" not in row, row.get("error")
    assert all(a["prefix"] == 1.0 for a in row["agreement"].values())


def test_agreement_counts_positions_before_the_first_divergence(decoder):
    reference = torch.arange(16).view(2, 8)
    tokens = reference.clone()
    tokens[0, 3] = -1  # row 0 diverges at step 3 and agrees again later: prefix 3/8, overall 7/8
    assert decoder.agreement(tokens, reference) == {"prefix": (3 / 8 + 1) / 2, "overall": 15 / 16}


def test_speedups_are_against_the_best_bf16_mode_of_each_figure(decoder):
    """tokens/s: the highest bf16 figure is the baseline; prefill ms: the lowest. A failed
    bf16 mode is no baseline."""
    rows = {
        "bf16 default": {"tokens_per_s": {"b1": 100.0}, "prefill_ms": {"512": 10.0}},
        "bf16 reduce-overhead": {"tokens_per_s": {"b1": 200.0}, "prefill_ms": {"512": 20.0}},
        "bf16 freezing": {"error": "Traceback ..."},
        "fxopt int8": {"tokens_per_s": {"b1": 300.0}, "prefill_ms": {"512": 8.0}},
    }
    got = decoder.speedups(rows)
    assert got["fxopt int8"] == {"decode_b1": 1.5, "prefill_512": 1.25}
    assert got["bf16 default"] == {"decode_b1": 0.5, "prefill_512": 1.0}
    assert "bf16 freezing" not in got
