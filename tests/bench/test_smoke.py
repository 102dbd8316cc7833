"""Every ported bench runs its ``--smoke`` mode on the CPU, so that none of them rots.

Each runs in this process (``main(argv)`` returns what it wrote) with tiny shapes; the test
checks the record's layout (the environment, one row per measured thing, the fields and
variants the bench promises), never a figure. The quantization benches are not on the
harness yet.
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
