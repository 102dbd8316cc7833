"""Every ported bench runs its ``--smoke`` mode on the CPU, so that none of them rots.

Each runs in this process (``main(argv)`` returns what it wrote) with tiny shapes; the test
checks the record's layout (the environment, one row per measured thing, the fields and
variants the bench promises), never a figure. Every bench is on the harness;
bench/int8_defaults_from_cache.py measures nothing: it is the tool that merges an int8
tuning cache into fxopt's shipped table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import harness
import pytest

#: bench -> (extra arguments, the check of its record)
Check = Callable[[dict[str, Any]], None]


def _fields(*names: str) -> Check:
    def check(data: dict[str, Any]) -> None:
        for row in data["rows"]:
            assert "error" not in row, row
            missing = [n for n in names if n not in row]
            assert not missing, (missing, row)
    return check


def _gpu_zoo(data: dict[str, Any]) -> None:
    (row,) = data["rows"]
    for variant in ("eager", *harness.INDUCTOR_MODES, "fxopt"):
        assert "ms" in row[variant] and "rel_l2_vs_fp32" in row[variant], (variant, row[variant])
    for variant in harness.MUST_FREEZE:
        assert row[variant]["frozen"] is True, (variant, row[variant])
    assert row["modes_timed"] == list(harness.INDUCTOR_MODES)
    assert "harness_problems" not in row and row["numerics_ok"] is True


def _spellings(data: dict[str, Any]) -> None:
    got = {r["spelling"]: r for r in data["rows"]}
    assert got["aten.convolution"]["cpu_us_per_call"] > 0 and got["aten.relu"]["cpu_us_per_call"] > 0
    assert "error" in got["aten.cudnn_convolution_relu"]  # no cuDNN on a CPU: a row saying so


def _pass_manager(data: dict[str, Any]) -> None:
    assert [r["variant"] for r in data["rows"]] == ["by hand", "PassManager, instrumentation off",
                                                     "PassManager, instrumentation on"]
    assert all(len(r["samples"]) == 2 for r in data["rows"])


def _pass_growth(data: dict[str, Any]) -> None:
    assert len(data["rows"]) == 2 and data["rows"][0]["nodes"] < data["rows"][1]["nodes"]
    assert "optimize (total, CPU)" in data["growth"] and "cse" in data["growth"]


def _fusion(data: dict[str, Any]) -> None:
    add_relu = next(r for r in data["rows"] if r["part"] == "add_relu")
    assert add_relu["bitwise_equal"] is True
    model = [r for r in data["rows"] if r["part"] == "model"][-1]
    for key in ("eager_ms", "eager_fxopt_ms", "inductor_ms", "inductor_freezing_ms", "fxopt_inductor_ms"):
        assert isinstance(model[key], float), (key, model[key])
    assert model["frozen"]["freezing=True,keep_cudnn=False"] is True and "harness_problems" not in model


def _profile(data: dict[str, Any]) -> None:
    checks = data["checks"]
    for name in ("mlp_64x8", "transformer_encoder_b1"):
        assert isinstance(checks[name], dict) and checks[name]["time_ratio"] > 0, checks[name]
    assert checks["cli"]["exit"] == 0 and isinstance(checks["overhead_chain"], dict)


def _memory(data: dict[str, Any]) -> None:
    (row,) = data["rows"]
    assert row["model"] == "resnet18" and row["arena/bound"] >= 1 and row["arena_bitwise"] is True
    assert data["scaling"]["buffers"] == 10000


def _host_cost(data: dict[str, Any]) -> None:
    assert {(r["mode"], r["variant"]) for r in data["rows"]} == {
        (m, v) for m in ("whole", "model") for v in ("inductor", "fxopt-plain")}
    for mode in ("whole", "model"):  # both compiled the same function
        first = {r["first_loss"] for r in data["rows"] if r["mode"] == mode}
        assert max(first) - min(first) < 1e-5, first


def _distributed(data: dict[str, Any]) -> None:
    assert {(r["wrapping"], r["compiler"]) for r in data["rows"]} == {("ddp", "eager"), ("fsdp-model", "eager")}
    assert data["meta"]["ranks"] == 1


def _training(data: dict[str, Any]) -> None:
    (row,) = data["rows"]
    assert row["variant"] == "eager" and row["step_ms"] > 0 and len(row["losses"]) == 3, row
    assert "eager" in data["table"]


def _lowbit_probe(data: dict[str, Any]) -> None:
    assert {(r["shape"], r["M"]) for r in data["rows"]} == {(s, m) for s in ("gate+up", "down") for m in (1, 32)}
    for row in data["rows"]:
        ran = ["bf16", "wo_triton", "wo_reference", "int4_fxopt"]
        ran += ["int_mm", "int_mm_2m", "rescale", "quant_rows", "w8a8_triton", "w8a8_triton_2m", "fp8_rowwise"] \
            if row["M"] > 16 else []
        assert all(isinstance(row[label], float) for label in ran), row
        for label in ("two_term", "dequant_cublas", "int4_tinygemm", "gemlite_a16w8"):  # a row saying why
            assert row[label] is None and row[f"{label}_skipped"], (label, row)


def _w8a8_sqnr(data: dict[str, Any]) -> None:
    _fields("scheme", "sqnr_db")(data)
    schemes = [r["scheme"] for r in data["rows"]]
    assert schemes[0] == "weight-only" and "per-token" in schemes and schemes[-1] == "per-token + smoothing", schemes


QUANT_SERVING = ["bf16 freezing", "int8 fxopt", "int8 compile unbacked", "int4 compile", "torchao int8"]


def _quant_serving(data: dict[str, Any]) -> None:
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == QUANT_SERVING
    for name in QUANT_SERVING[:-1]:
        row = rows[name]
        assert "error" not in row and "harness_problem" not in row, row
        assert list(row["first_call_s"]) == list(row["sqnr_vs_fp32"]) == [str(m) for m in data["meta"]["serving_order"]]
        assert list(row["ms"]) == [str(m) for m in data["meta"]["timed_ms"]] and "host_us_m1" in row
    assert rows["bf16 freezing"]["frozen"] is True and rows["int8 fxopt"]["frozen"] is True
    assert rows["int8 compile unbacked"]["dynamo_graphs"] == 1  # one graph for every M
    assert "ms" in rows["torchao int8"] or "torchao" in rows["torchao int8"]["error"]  # a row saying why
    assert set(data["speedups"]) >= set(QUANT_SERVING[1:-1])
    assert set(data["sqnr_vs_fp32_m64"]) == {"bf16", "int8 eager", "int4 eager"}
    assert data["inductor_code_m1"]["fxopt_op_calls"] > 0


DECODER = ["bf16 reduce-overhead freezing", "fxopt int8 backend", "torchao int4"]


def _decoder(data: dict[str, Any]) -> None:
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == DECODER
    meta = data["meta"]
    shapes = {f"decode_b{b}" for b in meta["batches"]} | {f"prefill_{n}" for n in meta["prefill"]}
    for name in DECODER[:2]:
        row = rows[name]
        assert "error" not in row, row.get("error")
        assert set(row["first_call_s"]) == shapes and set(row["tokens_per_s"]) == {f"b{b}" for b in meta["batches"]}
        assert set(row["prefill_ms"]) == {str(n) for n in meta["prefill"]}
        assert row["graphs"] == len(shapes)  # one per shape: no recompile per decode position
    # the eager backend runs the reference's very ops: the same greedy tokens
    assert all(a == {"prefix": 1.0, "overall": 1.0} for a in rows[DECODER[0]]["agreement"].values())
    # every linear layer quantized: 5 per block (wqkv, wo, w1, w3, w2) and the output head
    assert rows["fxopt int8 backend"]["quantized"] == {"parts": 2 * 3 + 1, "sites": 2 * 5 + 1, "min_coverage": 1.0}
    assert rows["torchao int4"]["error"].startswith("skipped")  # a row saying why
    assert set(data["speedups"]) == set(DECODER[:2])


def _qat(data: dict[str, Any]) -> None:
    (row,) = data["rows"]
    assert row["seed"] == 0 and {"float", "ptq int8", "ptq int4", "qat int8", "qat int4"} <= set(row["results"])
    assert all(set(r) == {"acc", "nll"} for r in row["results"].values())
    assert "pt2e qat int8" in row["results"] or "torchao" in row["pt2e"]  # torchao's QAT, or why not


def _serving(data: dict[str, Any]) -> None:
    (row,) = data["rows"]
    assert (row["model"], row["route"], row["batches"]) == ("llama_mlp", "mark_dynamic", [4, 2])
    for variant in ("inductor_freezing", "fxopt"):
        entry = row[variant]
        assert "error" not in entry and entry["frozen"] is True, entry
        for b in (4, 2):
            assert f"ms_{b}" in entry and f"rel_l2_{b}_vs_eager" in entry
        assert entry["earlier_output_kept"] == "yes"  # plain-call semantics
    assert row["best_inductor_4"] == "inductor_freezing" and "speedup_2" in row


def _serving_seq(data: dict[str, Any]) -> None:
    (row,) = data["rows"]
    assert (row["model"], row["route"], row["lengths"]) == ("bert_base", "automatic", [8, 16])
    for variant in ("fxopt", "inductor"):
        entry = row[variant]
        assert "error" not in entry and entry["earlier_output_kept"] == "yes", entry
        for n in (8, 16):
            for key in ("ms", "first_call_s", "second_call_s", "max_abs", "rel_l2"):
                assert any(k.startswith(f"{key}_{n}") for k in entry), (key, n, entry)
    assert row["fxopt"]["frozen"] is True and "replay_logs" in row["fxopt"]
    assert row["modes_measured_8"] == ["inductor"] and "speedup_16" in row  # an upper bound: one mode


SMOKES: dict[str, tuple[list[str], Check]] = {
    "gpu_zoo": (["--models", "llama_mlp", "--rounds", "1"], _gpu_zoo),
    "vit_freezing_probe": ([], _fields("variant", "launch_ms")),
    "conv_call_cost": ([], _spellings),
    "pass_manager": ([], _pass_manager),
    "pass_growth": ([], _pass_growth),
    "testing_generator": ([], _fields("measure", "value")),
    "visualize": ([], _fields("nodes", "changes", "focus_cpu_s", "full_cpu_s")),
    "gemm_gelu": ([], _fields("shape", "eager", "inductor", "op", "op_vs_inductor", "inductor_err", "op_err")),
    "fusion_gpu": ([], _fusion),
    "profile_gpu": ([], _profile),
    "memory": ([], _memory),
    "real_models": ([], _fields("model", "path", "pipeline", "outcome", "max_rel_error")),
    "host_cost": ([], _host_cost),
    "distributed": (["--compilers", "eager", "--wrappings", "ddp,fsdp-model"], _distributed),
    "training": (["--variants", "eager", "--steps", "2", "--repeats", "1", "--warmup", "1"], _training),
    "grouped_conv_probe": ([], _fields("shape", "groups", "count", "channels_last", "nchw", "padded_32",
                                       "cudnn_benchmark")),
    "lowbit_probe": ([], _lowbit_probe),
    "w8a8_sqnr": ([], _w8a8_sqnr),
    "quant_serving": (["--variants", ",".join(QUANT_SERVING), "--rounds", "1"], _quant_serving),
    "decoder": (["--variants", ",".join(DECODER)], _decoder),
    "qat": ([], _qat),
    "serving": (["--models", "llama_mlp", "--routes", "mark_dynamic", "--variants", "inductor_freezing,fxopt",
                 "--batches", "4,2", "--rounds", "1"], _serving),
    "serving_seq": (["--variants", "fxopt,inductor", "--lengths", "8,16", "--rounds", "1"], _serving_seq),
}


def _frozen_check_cost(data: dict[str, Any]) -> None:
    assert [(r["model"], r["frozen_tensors"]) for r in data["rows"]] == [
        ("resnet50", 267), ("vit_b_16", 152), ("160 tensors", 160)]
    _fields("plain_us", "checked_us", "check_us")(data)
    assert [r["model"] for r in data["rows"] if "share_of_call" in r] == ["resnet50", "vit_b_16"]
    assert "yardstick_us" in data


def _optimize_scale(data: dict[str, Any]) -> None:
    symbolic, exported = data["rows"]
    assert (symbolic["capture"], exported["capture"]) == ("symbolic_trace", "torch.export")
    for row, parts in ((symbolic, ("default_pipeline", "fixed_copy", "fixed_validate_inputs_and_shapes")),
                       (exported, ("default_pipeline", "dce", "baseline_module_and_eliminate_dead_code"))):
        for part in parts:
            assert {"min_s", "median_s", "cpu_min_s", "ms_per_node", "cpu_ms_per_node"} <= set(row[part]), (part, row)
    assert "cse" in symbolic["passes_ms_per_node_last_run"]
    assert {"dce_vs_baseline_cpu", "model_MB", "peak_rss_above_start_MB"} <= set(exported)


def _optimize_time(data: dict[str, Any]) -> None:
    assert [(r["model"], r["path"]) for r in data["rows"]] == [("fxopt_demo", "symbolic_trace"), ("fxopt_demo", "dynamo")]
    _fields("nodes", "seconds", "cpu_seconds", "all", "passes")(data)
    assert all({"cse", "inplace", "plan_memory"} <= set(r["passes"]) for r in data["rows"])
    assert data["summary"]["timed"] == 2 and {"worst", "median_s", "over_1s"} <= set(data["summary"])


def _startup(data: dict[str, Any]) -> None:
    rows = {r["measure"]: r for r in data["rows"]}
    assert list(rows) == ["import torch", "import fxopt after torch", "get_pass_class('dce')",
                          "PassManager(DEFAULT_PIPELINE), not run", "registered_passes() (all modules)",
                          "torch._inductor imported"]
    for name, row in rows.items():
        fields = ("seen",) if name.endswith("imported") else ("wall_ms_min", "wall_ms_median", "cpu_ms_median")
        assert all(f in row for f in fields), row
    assert isinstance(data["meta"]["fxopt_bytecode_cached"], bool)


def _rewrite_scaling(data: dict[str, Any]) -> None:
    assert [r["kind"] for r in data["rows"]] == ["chain", "ladder"]
    _fields("nodes", "rewrites", "fxopt_s", "hand_s", "rules50_s", "fxopt_vs_hand", "rules50_vs_one",
            "replace_pattern_s")(data)
    for row in data["rows"]:  # within the smoke's cap, replace_pattern finishes and rewrites alike
        assert row["replace_pattern_capped"] is False and row["replace_pattern_rewrites"] == row["rewrites"], row


def _report(data: dict[str, Any]) -> None:
    (row,) = data["rows"]
    assert row["model"] == "stack_42" and row["js_errors"] == [], row
    assert row["diffs"] == len(row["passes"]) == len(row["diff_truth"]) and row["search_hits"], row
    _fields("optimize_s", "write_s", "write_cpu_s", "size_MB", "load_s", "search_ms", "nodes_drawn", "diffs_drawn")(data)
    assert data["meta"]["chromium"] and data["meta"]["renderer"]


def _varlen_training(data: dict[str, Any]) -> None:
    (row,) = data["rows"]  # eager alone: compiling a training step takes a minute on a CPU
    assert row["variant"] == "eager" and row["graphs"] == 0 and len(row["losses"]) == 9, row
    lengths = data["meta"]["lengths"]
    assert lengths == [16, 48, 32]
    _fields(*(f"ms_{n}" for n in lengths), *(f"warmup_s_{n}" for n in lengths), "variant_s")(data)
    assert data["speedup"] == {} and data["meta"]["workload"] == "bert_base_mlm"


SMOKES.update({
    "frozen_check_cost": ([], _frozen_check_cost),
    "optimize_scale": ([], _optimize_scale),
    "optimize_time": ([], _optimize_time),
    "startup": ([], _startup),
    "rewrite_scaling": ([], _rewrite_scaling),
    "report": ([], _report),
    "varlen_training": ([], _varlen_training),
})


@pytest.mark.parametrize("name", list(SMOKES))
def test_smoke(name, bench_script, tmp_path):
    argv, check = SMOKES[name]
    out = tmp_path / f"{name}.json"
    returned = bench_script(name).main(["--smoke", "--out", str(out), *argv])
    written = json.loads(out.read_text())
    returned = json.loads(json.dumps(returned, default=str))
    assert {k: v for k, v in returned.items() if k != "elapsed_s"} == \
        {k: v for k, v in written.items() if k != "elapsed_s"}  # what it returns is what it wrote
    meta = written["meta"]
    assert meta["device"] == "cpu" and meta["args"]["smoke"] is True
    for key in ("bench", "torch", "python", "commit", "cpu", "cores", "triton"):
        assert key in meta, key
    assert written["rows"] or written.get("checks"), written  # profile_gpu: one entry per named check
    check(written)


def test_every_bench_on_the_harness_has_a_smoke_test():
    """A bench script that imports the harness is in SMOKES: a new one cannot skip CI."""
    scripts = {p.stem for p in harness.records.RESULTS.parent.glob("*.py")
               if "from harness import" in p.read_text() or "import harness" in p.read_text()}
    assert scripts == set(SMOKES), scripts ^ set(SMOKES)
