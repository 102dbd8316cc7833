"""Low-bit decode and prefill in serving order: one compiled function per variant.

    pip install --no-deps .whl/torchao-*.whl    # torchao's side of the comparison (optional)
    python3 bench/quant_serving.py --out $OUT --first-call compile,fxopt    # needs a CUDA GPU
    python3 bench/quant_serving.py --smoke      # CPU, a 2-block stack of width 64 (CI)

Model: :class:`MLPStack`, a Llama-shaped MLP stack (8 blocks, d 4096, hidden 11008, bf16,
pre-RMSNorm + residual), quantized with default options: ``int8_weight_only``, then
``merge_sibling_linears`` and ``fuse_swiglu``. Every variant is compiled once and called in
serving order (``--serving``, default M = 1, 16, 32, 64, 256, 1024, 4096, then sizes between:
decode first, then ever larger prefills); the first call at each M is timed (compiling
included, warm process) and its SQNR against the fp32 model taken. Then every (variant, M
of ``--ms``) is timed with plain Python calls (the harness's ``call_ms``; no CUDA graph
unless the variant makes one itself), the variants in interleaved rounds (``--rounds``).
Variants (``--variants``), in this order:

- ``bf16 <mode>``: the float model through every Inductor mode a user could pick (the
  harness's ``INDUCTOR_MODES``: default, freezing, reduce-overhead, reduce-overhead +
  freezing; the freezing ones checked frozen); the quantized variants' ratios are against the
  fastest of them per M;
- ``int8 fxopt``: ``torch.compile(q, backend="fxopt")``;
- ``int8 compile``: ``torch.compile(q)``, the plain route; ``int8 ro``: ``mode="reduce-overhead"``;
  ``int8 compile unbacked``: the plain route with the token dim marked unbacked;
- ``int4 compile``, ``int4 ro``: ``torch.compile`` of ``int4_weight_only`` (default group size);
  ``--int4-sweep`` first sweeps the int4 GEMV's configurations at M = 1 and uses the fastest;
- ``torchao int8``, ``torchao int4``: ``Int8WeightOnlyConfig()`` / ``Int4WeightOnlyConfig(
  group_size=128)`` (tinygemm's ``tile_packed_to_4d`` packing, in torch itself; torchao's
  default packing needs fbgemm-gpu-genai) + ``torch.compile``, where torchao imports (else a
  row saying why). They run last: ``quantize_`` sets Inductor's global options the way
  torchao recommends, which are put back before the next variant.

The quantized variants compile as a user compiles them (no freezing: it would fold a
dequantized weight of the reference route into a constant). Each variant compiles its own
copy of the graph (weights shared), so Dynamo's state of one is not another's, and reports how
many graphs Dynamo compiled across the serving order; ``... unbacked`` marks the token dim
unbacked first, as a server marks it (no 0/1 specialization: one graph for every M). Per
variant also: ``host_us_m1``, the host's cost of a call at M = 1 (calls issued back to back),
and the device memory from before its first call (``peak_reserved_MB``: earlier variants'
reservations included, ``base_reserved_MB`` says how much). ``--budget-s`` skips the variants
left once it is spent (each says so). Before timing: SQNR of the eager int8/int4 models
against the fp32 model at M = 64; Inductor's code of ``torch.compile(q)`` at M = 1 is kept
(``quant_serving_inductor_m1.py`` next to the record) and searched for calls of the fxopt ops
(the opaque ops that choose their kernel at run time). ``--first-call``: the first calls in
fresh processes with empty Inductor, Triton and fxopt caches, before everything else:
quantize + compile + run at M = 1, then each new M in serving order (targets: 5 s, then 2 s per
new M); a child cut at ``--first-call-timeout`` reports the sizes it reached.

``--smoke`` runs the same code on the CPU in fp32 (the ops' CPU reference); the int4 sweep
needs CUDA and says so. The record goes to ``--out`` (a folder gets ``quant_serving.json``;
default ``bench/results/<gpu>/quant_serving.json``), rewritten after every variant.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from harness import (
    INDUCTOR_MODES,
    DeviceMemory,
    Record,
    alternate,
    call_ms,
    cli,
    cpu_threads,
    fresh_process,
    frozen_summary,
    inductor_variant,
    loop_ms,
    markdown_table,
    median,
    not_frozen,
    wall_ms,
)

import fxopt
import fxopt.quant as fq

D, HIDDEN, BLOCKS = 4096, 11008, 8
#: ``--smoke``: the stack's layers, tiny; and its serving order
SMOKE_STACK = {"blocks": 2, "d": 64, "hidden": 128}
SMOKE_SERVING, SMOKE_MS = "1,4,7", "1,4"
#: decode first, then ever larger prefills, then sizes between: 12 sizes, each new to Dynamo
SERVING = [1, 16, 32, 64, 256, 1024, 4096, 2, 8, 100, 513, 2000]
MS = [1, 16, 32, 64, 256, 1024, 4096]
#: the bf16 baselines' names -> the harness's Inductor modes
BF16_MODES = {"bf16 freezing": "inductor_freezing", "bf16 reduce-overhead freezing": "reduce_overhead_freezing",
              "bf16 default": "inductor", "bf16 reduce-overhead": "reduce_overhead"}
assert set(BF16_MODES.values()) == set(INDUCTOR_MODES)
#: variant -> (weights, how it compiles: an Inductor mode or "fxopt"); torchao's last
VARIANTS = {**{name: ("bf16", mode) for name, mode in BF16_MODES.items()},
            "int8 fxopt": ("int8", "fxopt"), "int8 compile": ("int8", "inductor"),
            "int8 ro": ("int8", "reduce_overhead"), "int8 compile unbacked": ("int8", "inductor"),
            "int4 compile": ("int4", "inductor"), "int4 ro": ("int4", "reduce_overhead"),
            "torchao int8": ("torchao8", "inductor"), "torchao int4": ("torchao4", "inductor")}
#: int4 GEMV launch configurations swept at M = 1: (BLOCK_N, GROUPS, warps, stages)
INT4_GEMV = [(8, 4, 4, 1), (8, 2, 4, 2), (16, 2, 4, 2), (16, 4, 4, 1), (4, 8, 4, 1), (8, 8, 4, 1),
             (32, 2, 8, 2), (16, 8, 8, 1), (8, 4, 2, 2), (4, 4, 2, 2)]


class GatedMLP(nn.Module):
    """Llama's MLP sub-block: pre-RMSNorm (no weight), SiLU-gated MLP, residual add."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class MLPStack(nn.Module):
    def __init__(self, blocks: int = BLOCKS, d: int = D, hidden: int = HIDDEN):
        super().__init__()
        self.blocks = nn.ModuleList(GatedMLP(d, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Workload:
    """The float model on the bench's device, its fp32 copy, and its quantized forms (made
    once, on first use): what every variant compiles a copy of."""

    def __init__(self, smoke: bool):
        self.device, self.dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
        torch.manual_seed(0)
        self.model = MLPStack(**(SMOKE_STACK if smoke else {})).to(self.device, self.dtype).eval()
        for p in self.model.parameters():
            nn.init.normal_(p, std=0.02)
        self.d = self.model.blocks[0].gate.in_features
        self.fp32 = copy.deepcopy(self.model).float()
        self._quantized: dict[str, fx.GraphModule] = {}

    def tokens(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.d, device=self.device, dtype=self.dtype)

    def quantized(self, mode: str) -> fx.GraphModule:
        """The model quantized with default options (int8: gate/up merged, SwiGLU fused)."""
        if mode not in self._quantized:
            x1 = self.tokens(1)
            q = fq.quantize_model(fx.symbolic_trace(self.model), (x1,), mode)
            if mode == "int8_weight_only":
                q = fxopt.optimize(q, ["merge_sibling_linears", "fuse_swiglu"], example_inputs=(x1,))
            self._quantized[mode] = q
        return self._quantized[mode]

    def graph_of(self, kind: str) -> nn.Module:
        """A module of its own (its own code object for Dynamo, the weights shared) for one
        variant: the traced float model, a copy of a quantized graph, or torchao's model."""
        if kind == "bf16":
            return fx.symbolic_trace(self.model)
        if kind in ("int8", "int4"):
            q = self.quantized(f"{kind}_weight_only")
            return fx.GraphModule(q, copy.deepcopy(q.graph))
        model, why = torchao_model(fx.symbolic_trace(self.model), 8 if kind == "torchao8" else 4)
        if model is None:
            raise Unavailable(why)
        return model


class Unavailable(Exception):
    """A variant that cannot be built here, and why (a row saying so, not a failure)."""


@contextlib.contextmanager
def kept_globals() -> Iterator[None]:
    """Inductor's options and the float32 matmul precision as they were before the block:
    torchao's ``quantize_`` sets both its way (coordinate-descent tuning, ...)."""
    inductor_config, matmul_precision = torch._inductor.config.save_config(), torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch._inductor.config.load_config(inductor_config)
        torch.set_float32_matmul_precision(matmul_precision)


def torchao_model(model: nn.Module, bits: int) -> tuple[nn.Module | None, str]:
    """torchao's int8 or int4 weight-only on a copy of the model, or the reason it cannot run."""
    try:
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return None, f"torchao does not import: {type(exc).__name__}: {exc}"
    config = (Int8WeightOnlyConfig() if bits == 8
              else Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
    try:
        ao = copy.deepcopy(model)
        quantize_(ao, config)
        return ao, f"torchao {torchao.__version__}: {config}"
    except Exception as exc:  # noqa: BLE001
        return None, f"torchao quantize_ failed: {type(exc).__name__}: {exc}"


def compiled(name: str, wl: Workload, stats: dict[str, Any]) -> tuple[Callable, Callable]:
    """The variant's compiled function and the context its calls run in."""
    kind, how = VARIANTS[name]
    module = wl.graph_of(kind)
    if how == "fxopt":
        stats["reports"] = []
        return torch.compile(module, backend="fxopt", options={"reports": stats["reports"]}), contextlib.nullcontext
    return inductor_variant(how, module, stats)


def serve(name: str, fn: Callable, wl: Workload, serving: list[int], ms: list[int], row: dict[str, Any]
          ) -> dict[int, torch.Tensor]:
    """Call ``fn`` in serving order: per M its first call's seconds and SQNR against the fp32
    model, then Dynamo's graph count and the host's cost of a call at M = 1. Returns the
    inputs the timing rounds use (marked unbacked for ``... unbacked``)."""
    first, quality = row.setdefault("first_call_s", {}), row.setdefault("sqnr_vs_fp32", {})
    torch.manual_seed(1)
    inputs = {m: wl.tokens(m) for m in sorted({*serving, *ms, 1})}
    if name.endswith("unbacked"):  # the token dim marked as a server marks it: no 0/1 specialization
        for x in inputs.values():
            torch._dynamo.decorators.mark_unbacked(x, 0)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for m in serving + [m for m in ms if m not in serving]:
        first[str(m)] = round(wall_ms(lambda x=inputs[m]: fn(x), wl.device, reps=1, warmup=0) / 1e3, 3)
        quality[str(m)] = round(fq.sqnr(wl.fp32(inputs[m].float()), fn(inputs[m])), 2)
    row["dynamo_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
    row["host_us_m1"] = loop_ms(lambda: fn(inputs[1]), wl.device, reps=5, host=True) * 1e3
    return inputs


def build_and_serve(name: str, wl: Workload, serving: list[int], ms: list[int], row: dict[str, Any]
                    ) -> tuple[Callable, Callable, dict[int, torch.Tensor]] | None:
    """Compile ``name`` and serve it (:func:`serve`), its memory counted from before the
    first call; ``None`` (``row["error"]`` says why) where it cannot run."""
    stats: dict[str, Any] = {}
    try:
        with kept_globals():
            fn, context = compiled(name, wl, stats)
            with torch.no_grad(), context(), DeviceMemory(wl.device) as memory:
                inputs = serve(name, fn, wl, serving, ms, row)
    except Unavailable as why:
        row["error"] = str(why)
        return None
    except Exception:  # noqa: BLE001 - a variant that fails is a finding, reported whole
        row["error"] = traceback.format_exc()[-3000:]
        return None
    row.update(memory.record(), **frozen_summary(VARIANTS[name][1], stats))
    problem = not_frozen(VARIANTS[name][1], row)
    if problem:
        row["harness_problem"] = problem
    if "reports" in stats:
        row["fxopt_graphs"] = [{"no_replay": g.no_replay, "fallback": g.fallback} for g in stats["reports"]]
    return fn, context, inputs


def time_variants(rows: dict[str, dict[str, Any]], served: dict[str, tuple], ms: list[int], device: str,
                  rounds: int) -> None:
    """Every (variant, M) of ``ms`` with plain calls, the variants in interleaved rounds:
    ``ms`` per variant (median) and ``ms_samples``."""
    def measure(key: tuple[str, int]) -> float:
        fn, context, inputs = served[key[0]]
        with torch.no_grad(), context():
            return call_ms(lambda: fn(inputs[key[1]]), device)

    def failed(key: tuple[str, int], exc: BaseException) -> None:
        rows[key[0]]["error"] = f"while timing M={key[1]}: {type(exc).__name__}: {str(exc)[:500]}"

    samples = alternate({(name, m): (name, m) for name in served for m in ms}, rounds, measure,
                        on_error=failed, reverse_odd=True)
    for (name, m), times in samples.items():
        rows[name].setdefault("ms", {})[str(m)] = median(times)
        rows[name].setdefault("ms_samples", {})[str(m)] = times


def speedups(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each quantized variant per M against the fastest bf16 mode of that M, named."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, row in rows.items():
        if name in BF16_MODES or "ms" not in row:
            continue
        for m, t in row["ms"].items():
            timed = [(r["ms"][m], v) for v, r in rows.items() if v in BF16_MODES and m in r.get("ms", {})]
            if timed:
                best, mode = min(timed)
                out.setdefault(name, {})[m] = {"vs_best_bf16": round(best / t, 3), "best_bf16": mode}
    return out


def inductor_code(q: fx.GraphModule, wl: Workload, folder: Path) -> dict[str, Any]:
    """Inductor's code for torch.compile(q) at M = 1 (kept in ``folder``): fxopt op calls
    left, user kernels, copies."""
    from torch._inductor.utils import run_and_get_code

    try:
        with torch.no_grad():
            _, codes = run_and_get_code(torch.compile(q), wl.tokens(1))
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()[-3000:]}
    code = "\n".join(codes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "quant_serving_inductor_m1.py").write_text(code)
    return {"fxopt_op_calls": code.count("fxopt_quant"),
            "user_kernels": sorted(set(re.findall(r"\b(_gemv|_gemm|_gemv_int4|_gemm_int4|_splitk_reduce)\w*", code))),
            "clones": len(re.findall(r"\bclone\b|aten\.copy_", code))}


def rotated_us(call: Callable[[Any], Any], weights: list) -> float:
    """us per ``call(weight)``, cycling through ``weights`` in one CUDA-graph replay."""
    call(weights[0])  # Triton compiles outside the capture
    return 1e3 * call_ms(lambda: [call(w) for w in weights], "cuda", graph=True) / len(weights)


def int4_sweep(wl: Workload) -> list[dict[str, Any]]:
    """us per call of each int4 configuration at M = 1 on the stack's shapes (CUDA-graph
    replay over 8 weights, so none is in L2), against F.linear on bf16, checked first."""
    from fxopt.quant import triton_kernels as tk
    from fxopt.quant.formats import pack_int4, unpack_int4

    rows = []
    for n, k in ((HIDDEN, D), (D, HIDDEN)):
        group = 128 if k % 128 == 0 else 64
        packed = [pack_int4(torch.randn(n, k, device="cuda"), group) for _ in range(8)]
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ unpack_int4(*packed[0], group).t()
        bf16 = rotated_us(lambda w, x=x: F.linear(x, w), w16)
        for bn, gi, warps, stages in INT4_GEMV:
            config = {"BLOCK_N": bn, "GROUPS": gi, "num_warps": warps, "num_stages": stages}
            row: dict[str, Any] = {"N": n, "K": k, "group": group, "kernel": "gemv", "config": config, "bf16_us": bf16}

            def call(p: tuple, x: torch.Tensor = x, group: int = group, config: dict = config) -> torch.Tensor:
                return tk.int4_weight_only_linear(x, *p, group, None, "gemv", config)
            try:
                row["sqnr_vs_dequant"] = fq.sqnr(ref, call(packed[0]))
                row["us"] = rotated_us(call, packed)
                row["TBps"] = (n * k / 2 + n * k / group * 4) / row["us"] / 1e6
            except Exception as exc:  # noqa: BLE001 - a configuration that does not run is a result
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(f"int4 {n}x{k} g{group} {config}: {row.get('us', row.get('error'))} us (bf16 {bf16:.1f} us)", flush=True)
    return rows


def use_fastest_int4_gemv(sweep: list[dict[str, Any]]) -> dict[str, int]:
    """The int4 GEMV's configuration fastest over the stack's layers (gate, up: 11008x4096;
    down: 4096x11008), made the kernels' own for the int4 variants."""
    from fxopt.quant import triton_kernels as tk

    def stack_us(config: dict[str, int]) -> float:
        times = {r["K"]: r.get("us", float("inf")) for r in sweep if r["config"] == config}
        return 2 * times[D] + sum(t for k, t in times.items() if k != D)

    best = min((r["config"] for r in sweep), key=stack_us)
    tk.INT4_GEMV_CONFIG.clear()
    tk.INT4_GEMV_CONFIG.update(best)
    return best


def first_call_child(args: argparse.Namespace) -> dict[str, Any]:
    """``--child ROUTE`` (a fresh process, empty caches): quantize, compile, call at M = 1,
    then each new M in serving order; the record is rewritten after every call, so a child
    killed at its time limit still reports the sizes it reached."""
    route, serving = args.child, [int(m) for m in args.serving.split(",")]
    record = Record("quant_serving_first_call", args, cli.device_for(args))
    times = record.add({"route": route})
    start = time.perf_counter()
    wl = Workload(args.smoke)
    times["model_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    q = wl.quantized("int4_weight_only" if route == "int4" else "int8_weight_only")
    times["quantize_s"] = round(time.perf_counter() - start, 3)
    fn = torch.compile(q, backend="fxopt") if route == "fxopt" else torch.compile(q)
    with torch.no_grad():
        for m in [1] + [m for m in serving if m != 1]:
            x = wl.tokens(m)
            torch._dynamo.decorators.mark_unbacked(x, 0)  # as a server marks its token dim
            times[str(m)] = round(wall_ms(lambda x=x: fn(x), wl.device, reps=1, warmup=0) / 1e3, 3)
            if m == 1:
                times["quantize_compile_run_m1_s"] = round(times["quantize_s"] + times["1"], 3)
            record.save()
    times["worst_new_m_s"] = max(times[str(m)] for m in serving if m != 1)
    times["dynamo_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    record.save()
    return record.data


def first_calls(routes: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each route's first calls in a fresh process with empty caches (:func:`first_call_child`)."""
    out = {}
    for route in routes:
        argv = ["--child", route, "--serving", args.serving, *(["--smoke"] if args.smoke else [])]
        with tempfile.TemporaryDirectory() as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton",
                   "FXOPT_CACHE_DIR": f"{cache}/fxopt"}
            child = fresh_process(__file__, argv, args.first_call_timeout, env=env)
        out[route] = {**(child.get("rows") or [{}])[0], **({"error": child["error"]} if "error" in child else {})}
        print(f"first call ({route}, cold caches): {out[route]}", flush=True)
    return out


def eager_checks(wl: Workload, xs: torch.Tensor, int4: bool, record: Record) -> None:
    """Before any variant: the eager models' SQNR against the fp32 model at ``xs``, and
    Inductor's code of the int8 model at M = 1 (:func:`inductor_code`)."""
    with torch.no_grad():
        ref = wl.fp32(xs.float())
        record.extra["sqnr_vs_fp32_m64"] = {"bf16": fq.sqnr(ref, wl.model(xs)),
                                            "int8 eager": fq.sqnr(ref, wl.quantized("int8_weight_only")(xs))}
        if int4:
            q4 = wl.quantized("int4_weight_only")
            record.extra["sqnr_vs_fp32_m64"]["int4 eager"] = fq.sqnr(ref, q4(xs))
            record.extra["int4_group_sizes"] = sorted({r.group_size for r in fq.summary_of(q4).sites if r.group_size})
    record.extra["inductor_code_m1"] = inductor_code(wl.quantized("int8_weight_only"), wl, record.path.parent)


def run(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The whole run: cold first calls, the int4 sweep, the checks, every variant served and
    timed; the record's data."""
    began = time.perf_counter()
    serving, ms = [int(m) for m in args.serving.split(",")], [int(m) for m in args.ms.split(",")]
    wl = Workload(args.smoke)
    record = Record("quant_serving", args, wl.device, dtype=str(wl.dtype), serving_order=serving, timed_ms=ms)
    if args.first_call:  # first: fresh processes, bounded, and cold whatever runs below
        record.extra["first_call_cold"] = first_calls(args.first_call.split(","), args)
    if args.int4_sweep and wl.device != "cuda":
        record.extra["int4_sweep_m1"] = "skipped: CUDA only (Triton kernels)"
    elif args.int4_sweep:
        record.extra["int4_sweep_m1"] = sweep = int4_sweep(wl)
        record.extra["int4_gemv_config"] = use_fastest_int4_gemv(sweep)
    xs = wl.tokens(64)
    eager_checks(wl, xs, any(VARIANTS[v][0] == "int4" for v in names), record)
    rows: dict[str, dict[str, Any]] = {}
    served: dict[str, tuple] = {}
    for name in sorted(names, key=lambda v: v.startswith("torchao")):  # torchao's global options: last
        rows[name] = record.add({"variant": name})
        if time.perf_counter() - began > args.budget_s:
            rows[name]["error"] = f"skipped: the budget of {args.budget_s} s was spent"
        elif (done := build_and_serve(name, wl, serving, ms, rows[name])) is not None:
            served[name] = done
        print(f"{name}: {rows[name]}", flush=True)
        record.save()
    time_variants(rows, served, ms, wl.device, args.rounds)
    with torch.no_grad():
        for name, (fn, context, _) in served.items():
            kind = VARIANTS[name][0]
            if kind in ("int8", "int4"):  # the compiled variant computes what the eager model does
                with context():
                    rows[name]["sqnr_vs_eager_m64"] = fq.sqnr(wl.quantized(f"{kind}_weight_only")(xs), fn(xs))
    record.extra["speedups"] = ratios = speedups(rows)
    record.save()
    print(markdown_table([{"variant": v, **{f"M={m}": r["vs_best_bf16"] for m, r in by_m.items()}}
                          for v, by_m in ratios.items()], ["variant", *(f"M={m}" for m in ms)]))
    return record.data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.splitlines()[0])
    parser.add_argument("--serving", default=None, help="M of each first call, in order (default: SERVING)")
    parser.add_argument("--ms", default=None, help="M values timed after serving (default: MS)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from: {', '.join(VARIANTS)}")
    parser.add_argument("--int4-sweep", action="store_true")
    parser.add_argument("--first-call", default="", help="routes timed cold: compile,fxopt,int4")
    parser.add_argument("--first-call-timeout", type=float, default=100.0, help="seconds per cold child")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="skip the variants left once this many seconds have passed (first calls included)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.serving = args.serving or (SMOKE_SERVING if args.smoke else ",".join(map(str, SERVING)))
    args.ms = args.ms or (SMOKE_MS if args.smoke else ",".join(map(str, MS)))
    if args.child:
        return first_call_child(args)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    with cpu_threads(1 if args.smoke else None):  # tiny matrices: threads cost more than they save
        return run(args, names)


if __name__ == "__main__":
    main()
