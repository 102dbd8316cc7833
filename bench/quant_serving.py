"""Low-bit decode and prefill in serving order: one compiled function per variant.

    pip install --no-deps .whl/torchao-*.whl    # torchao's side of the comparison (optional)
    python3 bench/quant_serving.py --out $OUT --first-call compile,fxopt    # needs a CUDA GPU

Model: :class:`MLPStack`, a Llama-shaped MLP stack (8 blocks, d 4096, hidden 11008, bf16,
pre-RMSNorm + residual), quantized with default options: ``int8_weight_only``, then
``merge_sibling_linears`` and ``fuse_swiglu``. Every variant is compiled once and called in
serving order (``--serving``, default M = 1, 16, 32, 64, 256, 1024, 4096: decode first, then
ever larger prefills); the first call at each M is timed (compiling included, warm process)
and its SQNR against the fp32 model taken, then each M of ``--ms`` is timed with plain Python
calls (``triton.testing.do_bench``, median; no CUDA graph unless the variant makes one
itself). Variants, side by side in one process (the bf16 ones compiled with Inductor's global
``freezing`` flag, the quantized ones without), in this order:

- ``bf16``: ``torch.compile(model)`` (the baseline); ``bf16 ro``: ``mode="reduce-overhead"``;
- ``int8 fxopt``: ``torch.compile(q, backend="fxopt")``;
- ``int8 compile``: ``torch.compile(q)``, the plain route; ``int8 ro``: ``mode="reduce-overhead"``;
  ``int8 compile unbacked``: the plain route with the token dim marked unbacked;
- ``int4 compile``, ``int4 ro``: ``torch.compile`` of ``int4_weight_only`` (default group size);
  ``--int4-sweep`` first sweeps the int4 GEMV's configurations at M = 1 and uses the fastest;
- ``torchao int8``, ``torchao int4``: ``Int8WeightOnlyConfig()`` / ``Int4WeightOnlyConfig(
  group_size=128)`` (tinygemm's ``tile_packed_to_4d`` packing, in torch itself; torchao's
  default packing needs fbgemm-gpu-genai) + ``torch.compile``, where torchao imports (else a
  row saying why). They run last: ``quantize_`` sets Inductor's global options the way
  torchao recommends, which must not touch the other variants.

``--budget-s`` skips the variants left once it is spent (each says so). Before timing:
SQNR of the eager int8/int4 models against the fp32 model at M = 64; Inductor's code of
``torch.compile(q)`` at M = 1 is kept and searched for calls of the fxopt ops (the opaque
ops that choose their kernel at run time). Each variant reports how many graphs Dynamo
compiled across the serving order; ``... unbacked`` marks the token dim unbacked first, as a
server marks it (no 0/1 specialization: one graph for every M). ``--first-call``: the first calls in fresh
subprocesses with empty Inductor, Triton and fxopt caches, before everything else: quantize +
compile + run at M = 1, then each new M in serving order (targets: 5 s, then 2 s per new M).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # an installed fxopt first
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fxopt  # noqa: E402
import fxopt.quant as fq  # noqa: E402

#: decode first, then ever larger prefills, then sizes between: 12 sizes, each new to Dynamo
SERVING = [1, 16, 32, 64, 256, 1024, 4096, 2, 8, 100, 513, 2000]
MS = [1, 16, 32, 64, 256, 1024, 4096]
VARIANTS = ("bf16,bf16 ro,int8 fxopt,int8 compile,int8 ro,int8 compile unbacked,int4 compile,int4 ro,"
            "torchao int8,torchao int4")


D, HIDDEN, BLOCKS = 4096, 11008, 8


class GatedMLP(nn.Module):
    """Llama's MLP sub-block: pre-RMSNorm (no weight), SiLU-gated MLP, residual add."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class MLPStack(nn.Module):
    def __init__(self, blocks: int = BLOCKS, d: int = D, hidden: int = HIDDEN):
        super().__init__()
        self.blocks = nn.ModuleList(GatedMLP(d, hidden) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def bench(fn, graph: bool) -> float:
    """Median ms of ``fn()``; as a CUDA graph replay when ``graph`` (after warm-up)."""
    from triton.testing import do_bench

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return do_bench(g.replay, warmup=25, rep=200, return_mode="median")
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def log(*args) -> None:
    print(*args, flush=True)


def float_model() -> nn.Module:
    torch.manual_seed(0)
    model = MLPStack().to("cuda", torch.bfloat16).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    return model


def quantized(model: nn.Module, mode: str = "int8_weight_only") -> fx.GraphModule:
    """The model quantized with default options (int8: gate/up merged, SwiGLU fused)."""
    x1 = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    q = fq.quantize_model(fx.symbolic_trace(model), (x1,), mode)
    if mode == "int8_weight_only":
        q = fxopt.optimize(q, ["merge_sibling_linears", "fuse_swiglu"], example_inputs=(x1,))
    return q


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp(min=1e-30)))


def serve(name: str, fn, serving: list[int], ms: list[int], row: dict, fp32: nn.Module) -> None:
    """Call ``fn`` in serving order (first call per M timed, its SQNR against ``fp32``),
    then time each M."""
    from triton.testing import do_bench

    first = row.setdefault("first_call_s", {})
    quality = row.setdefault("sqnr_vs_fp32", {})
    torch.manual_seed(1)
    inputs = {m: torch.randn(m, D, device="cuda", dtype=torch.bfloat16) for m in sorted(set(serving + ms + [1]))}
    if name.endswith("unbacked"):  # the token dim marked as a server marks it: no 0/1 specialization
        for x in inputs.values():
            torch._dynamo.decorators.mark_unbacked(x, 0)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for m in serving + [m for m in ms if m not in serving]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(inputs[m])
            torch.cuda.synchronize()
            first.setdefault(str(m), round(time.perf_counter() - start, 3))
            quality.setdefault(str(m), round(sqnr(fp32(inputs[m].float()), out), 2))
        row["dynamo_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
        ms_times = row.setdefault("ms", {})
        for m in ms:
            ms_times[str(m)] = do_bench(lambda m=m: fn(inputs[m]), warmup=25, rep=200, return_mode="median")
        row["host_us_m1"] = host_us(fn, inputs[1])
    log(f"{name}: {row['dynamo_graphs']} Dynamo graphs; first call s {first}; ms {({k: round(v, 4) for k, v in ms_times.items()})}; "
        f"SQNR vs fp32 dB {quality}; host us per call at M=1 {row['host_us_m1']:.1f}")


def host_us(fn, x: torch.Tensor, calls: int = 20) -> float:
    """Host time per call: ``calls`` calls issued back to back without synchronizing (the
    GPU queues them), best of five rounds."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def inductor_code(q: fx.GraphModule, out: str) -> dict:
    """Inductor's code for torch.compile(q) at M = 1: fxopt op calls left, user kernels."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(q), x)
    code = "\n".join(codes)
    with open(os.path.join(out, "quant_serving_inductor_m1.py"), "w") as f:
        f.write(code)
    return {"fxopt_op_calls": code.count("fxopt_quant"),
            "user_kernels": sorted(set(re.findall(r"\b(_gemv|_gemm|_gemv_int4|_gemm_int4|_splitk_reduce)\w*", code))),
            "clones": len(re.findall(r"\bclone\b|aten\.copy_", code))}


def torchao_model(model: nn.Module, bits: int):
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


#: int4 GEMV launch configurations swept at M = 1: (BLOCK_N, GROUPS, warps, stages)
INT4_GEMV = [(8, 4, 4, 1), (8, 2, 4, 2), (16, 2, 4, 2), (16, 4, 4, 1), (4, 8, 4, 1), (8, 8, 4, 1),
             (32, 2, 8, 2), (16, 8, 8, 1), (8, 4, 2, 2), (4, 4, 2, 2)]


def _rotated_us(call, weights: list) -> float:
    """us per ``call(weight)``, cycling through ``weights`` in one CUDA-graph replay."""
    return 1e3 * bench(lambda: [call(w) for w in weights], graph=True) / len(weights)


def int4_sweep() -> list[dict]:
    """us per call of each int4 configuration at M = 1 on the stack's shapes (CUDA-graph
    replay over 8 weights, so none is in L2), against F.linear on bf16, checked first."""
    from functools import partial

    from fxopt.quant import triton_kernels as tk
    from fxopt.quant.formats import pack_int4, unpack_int4

    def int4(x, group, kernel, config, packed):
        return tk.int4_weight_only_linear(x, *packed, group, None, kernel, config)

    configs = [("gemv", {"BLOCK_N": bn, "GROUPS": gi, "num_warps": w, "num_stages": st})
               for bn, gi, w, st in INT4_GEMV]
    rows = []
    for n, k in ((HIDDEN, D), (D, HIDDEN)):
        group = 128 if k % 128 == 0 else 64
        packed = [pack_int4(torch.randn(n, k, device="cuda"), group) for _ in range(8)]
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ unpack_int4(*packed[0], group).t()
        bf16 = _rotated_us(partial(torch.nn.functional.linear, x), w16)
        for kernel, config in configs:
            row = {"N": n, "K": k, "group": group, "kernel": kernel, "config": config, "bf16_us": bf16}
            call = partial(int4, x, group, kernel, config)
            try:
                row["sqnr_vs_dequant"] = sqnr(ref, call(packed[0]))
                row["us"] = _rotated_us(call, packed)
                row["TBps"] = (n * k / 2 + n * k / group * 4) / row["us"] / 1e6
            except Exception as exc:  # noqa: BLE001 - a configuration that does not run is a result
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            log(f"int4 {n}x{k} g{group} {kernel} {config}: {row.get('us', row.get('error'))} us "
                f"(bf16 {bf16:.1f} us), SQNR {row.get('sqnr_vs_dequant')}")
    return rows


def first_call_child(route: str, serving: list[int]) -> None:
    """Child process (fresh caches): quantize, compile, call at M = 1, then each new M."""
    start = time.perf_counter()
    model = float_model()
    torch.cuda.synchronize()
    built = time.perf_counter() - start
    start = time.perf_counter()
    q = quantized(model, "int4_weight_only" if route == "int4" else "int8_weight_only")
    quantize_s = time.perf_counter() - start
    fn = torch.compile(q, backend="fxopt") if route == "fxopt" else torch.compile(q)
    times = {"model_s": round(built, 3), "quantize_s": round(quantize_s, 3)}
    with torch.no_grad():
        for m in [1] + [m for m in serving if m != 1]:
            x = torch.randn(m, D, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.decorators.mark_unbacked(x, 0)  # as a server marks its token dim
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn(x)
            torch.cuda.synchronize()
            times[str(m)] = round(time.perf_counter() - start, 3)
            if m == 1:
                times["quantize_compile_run_m1_s"] = round(times["quantize_s"] + times["1"], 3)
            print("FIRST_CALL " + json.dumps(times), flush=True)  # so far: a killed child still reports
    times["worst_new_m_s"] = max(times[str(m)] for m in serving if m != 1)
    times["dynamo_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print("FIRST_CALL " + json.dumps(times), flush=True)


def first_calls(routes: list[str], serving: list[int], timeout_s: float = 150) -> dict:
    """Each route's first calls in a fresh process with empty caches (``first_call_child``)."""
    out = {}
    for route in routes:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(cache, "triton"), "FXOPT_CACHE_DIR": os.path.join(cache, "fxopt")}
            try:
                proc = subprocess.run([sys.executable, __file__, "--child", route,
                                       "--serving", ",".join(map(str, serving))], env=env,
                                      capture_output=True, timeout=timeout_s)
                stdout, error = proc.stdout, proc.stderr.decode(errors="replace")[-2000:]
            except subprocess.TimeoutExpired as exc:  # what it measured before the limit still counts
                stdout, error = exc.stdout or b"", f"killed after {timeout_s} s"
        line = [text for text in stdout.decode(errors="replace").splitlines() if text.startswith("FIRST_CALL ")]
        out[route] = json.loads(line[-1].split(" ", 1)[1]) if line else {}
        if not line or "worst_new_m_s" not in out[route]:
            out[route]["error"] = error
        log(f"first call ({route}, cold caches): {out[route]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--serving", default=",".join(map(str, SERVING)), help="M of each first call, in order")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="M values timed after serving")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--int4-sweep", action="store_true")
    parser.add_argument("--first-call", default="", help="routes timed cold: compile,fxopt,int4")
    parser.add_argument("--first-call-timeout", type=float, default=100.0, help="seconds per cold child")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="skip the variants left once this many seconds have passed (first calls included)")
    parser.add_argument("--child")
    args = parser.parse_args()
    serving = [int(m) for m in args.serving.split(",")]
    if args.child:
        first_call_child(args.child, serving)
        return
    began = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    ms = [int(m) for m in args.ms.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ms": ms,
              "serving_order": serving, "variants": {}}
    import triton
    result["triton"] = triton.__version__
    if args.first_call:  # first: fresh processes, bounded, and cold whatever runs below
        result["first_call_cold"] = first_calls(args.first_call.split(","), serving, args.first_call_timeout)

    if args.int4_sweep:
        # the configuration fastest over the stack's layers (gate, up: 11008x4096; down:
        # 4096x11008) becomes the int4 GEMV's for the int4 variant below
        result["int4_sweep_m1"] = sweep = int4_sweep()
        from fxopt.quant import triton_kernels as tk

        def stack_us(config: dict) -> float:
            times = {r["K"]: r.get("us", float("inf")) for r in sweep if r["config"] == config}
            return 2 * times[D] + sum(t for k, t in times.items() if k != D)

        best = min((r["config"] for r in sweep), key=stack_us)
        tk.INT4_GEMV_CONFIG.clear()
        tk.INT4_GEMV_CONFIG.update(best)
        result["int4_gemv_config"] = best
        log("int4 GEMV config for the stack:", best)
    model = float_model()
    q = quantized(model)
    q4 = quantized(model, "int4_weight_only") if any(v.startswith("int4") for v in variants) else None
    if q4 is not None:
        result["int4_group_sizes"] = sorted({r.group_size for r in fq.summary_of(q4).sites if r.group_size})
    fp32 = copy.deepcopy(model).float()
    xs = torch.randn(64, D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = fp32(xs.float())
        result["sqnr_vs_fp32_m64"] = {"bf16": sqnr(ref, model(xs)), "int8 eager": sqnr(ref, q(xs))}
        if q4 is not None:
            result["sqnr_vs_fp32_m64"]["int4 eager"] = sqnr(ref, q4(xs))
    log("SQNR vs fp32 (M=64):", result["sqnr_vs_fp32_m64"])
    try:
        result["inductor_code_m1"] = inductor_code(q, args.out)
    except Exception:  # noqa: BLE001
        result["inductor_code_m1"] = {"error": traceback.format_exc()[-3000:]}
    log("Inductor code at M=1:", result["inductor_code_m1"])

    def torchao(bits: int):
        ao, why = torchao_model(model, bits)
        result.setdefault("torchao", {})[f"int{bits}"] = why
        log(why)
        return torch.compile(ao) if ao is not None else why

    builders = {
        "bf16": lambda: torch.compile(model),
        "bf16 ro": lambda: torch.compile(model, mode="reduce-overhead"),
        "int8 compile": lambda: torch.compile(q),
        "int8 ro": lambda: torch.compile(q, mode="reduce-overhead"),
        "int8 compile unbacked": lambda: torch.compile(q),
        "int4 ro": lambda: torch.compile(q4, mode="reduce-overhead"),
        "int8 fxopt": lambda: torch.compile(q, backend="fxopt"),
        "int4 compile": lambda: torch.compile(q4),
        "torchao int8": lambda: torchao(8),
        "torchao int4": lambda: torchao(4),
    }
    # torchao's quantize_ sets Inductor's global options: its variants go last
    for name in sorted(variants, key=lambda v: v.startswith("torchao")):
        row = result["variants"].setdefault(name, {})
        if time.perf_counter() - began > args.budget_s:
            row["error"] = f"skipped: the budget of {args.budget_s} s was spent"
            log(f"{name}: {row['error']}")
            continue
        try:
            torch._dynamo.reset()
            # the bf16 baselines with freezing; the quantized variants as a user compiles them
            # (freezing would fold a dequantized weight of the reference route into a constant)
            torch._inductor.config.freezing = name.startswith("bf16")
            fn = builders[name]()
            if isinstance(fn, str):
                row["error"] = fn
                continue
            serve(name, fn, serving, ms, row, fp32)
            if name.startswith(("int8", "int4")):
                with torch.no_grad():
                    eager = q(xs) if name.startswith("int8") else q4(xs)
                    row["sqnr_vs_eager_m64"] = sqnr(eager, fn(xs))
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-3000:]
            log(f"{name} failed:\n{row['error']}")
        with open(os.path.join(args.out, "quant_serving.json"), "w") as f:
            json.dump(result, f, indent=1)

    base = result["variants"].get("bf16", {}).get("ms", {})
    best = {m: min(v["ms"][m] for k, v in result["variants"].items() if k.startswith("bf16") and "ms" in v)
            for m in base}
    speedups = {}
    for name, row in result["variants"].items():
        if "ms" in row and not name.startswith("bf16"):
            speedups[name] = {m: {"vs_bf16_frz": round(base[m] / t, 3), "vs_best_bf16": round(best[m] / t, 3)}
                              for m, t in row["ms"].items() if m in base}
            log(f"{name}: " + ", ".join(f"M={m} {s['vs_bf16_frz']}x ({s['vs_best_bf16']}x best bf16)"
                                        for m, s in speedups[name].items()))
    result["speedups"] = speedups
    with open(os.path.join(args.out, "quant_serving.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
