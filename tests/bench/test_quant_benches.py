"""The quantization benches' parts that their ``--smoke`` runs in SMOKES leave out."""

from __future__ import annotations


def test_quant_serving_first_call_child_reports_every_size_it_reached(bench_script, tmp_path):
    """``--child ROUTE`` is what ``--first-call`` runs in a fresh process with empty caches
    (the harness's ``fresh_process``, tested on its own): here in this process, warm, for its
    record's layout. Its record is rewritten after every size, which is what a child killed
    at its time limit leaves for the parent."""
    data = bench_script("quant_serving").main(["--smoke", "--child", "fxopt", "--serving", "1,4",
                                               "--out", str(tmp_path / "child.json")])
    (row,) = data["rows"]
    assert row["route"] == "fxopt" and {"model_s", "quantize_s", "1", "4", "quantize_compile_run_m1_s"} <= set(row)
    assert row["worst_new_m_s"] == row["4"] and "dynamo_graphs" in row
