"""Every low-bit GEMM route available on this GPU, per Llama MLP shape and M, against cuBLAS bf16.

    python3 bench/lowbit_probe.py --out DIR [--ms 1,2,4,...] [--no-gemlite] [--only LABELS]
    python3 bench/lowbit_probe.py --smoke          # CPU, tiny shapes: the routes a CPU has (CI)

Which kernel should serve which M is a measurement, per GPU: this script times, for the
merged gate/up weight (N = 22016, K = 4096) and the down projection (N = 4096, K = 11008):

- ``bf16``: ``F.linear`` on a bf16 weight (cuBLAS), the baseline;
- ``wo_triton``: the int8 weight-only op (``torch.ops.fxopt_quant.int8_weight_only_linear``:
  on a GPU its run-time route, ``fxopt.quant.routes``);
- ``two_term``: the int8 ops' route up to the crossover (``fxopt.quant.int8_mm.two_term_linear``);
- ``dequant_cublas``: their route above it (``int8_mm.dequantized_linear``: one dequantizing
  pass, then cuBLAS); ``wo_reference``: the eager reference definition (three fp32 passes);
- above 16 rows, per-token int8 activations, one term or two (the activation and its
  rounding residual as two int8 rows each, so the product is as exact as weight-only's):
  ``w8a8_triton`` / ``w8a8_triton_2m`` (fxopt's int8 scaled GEMM), and the parts of the
  same on ``torch._int_mm`` (cuBLASLt int8 tensor cores): ``int_mm`` / ``int_mm_2m``,
  ``rescale``, ``quant_rows`` (fxopt's per-token quantization);
- ``fp8_rowwise``: ``torch._scaled_mm`` with e4m3 operands and row-wise scales;
- ``int4_tinygemm``: ``aten._weight_int4pack_mm`` (group 128), ``int4_fxopt``: fxopt's int4;
- ``gemlite_a16w8``: gemlite's int8 weight-only Triton kernels (where gemlite imports).

Each time is the harness's ``call_ms`` of one CUDA-graph replay of calls over enough distinct
weights that none is found in L2, divided by their count, in microseconds; the routes of one
(shape, M) run in interleaved rounds (``--rounds``). A route that cannot run here is a
column of None with ``<label>_skipped`` (a CPU has no Triton GPU kernels nor tinygemm's
packing; gemlite may not import) or ``<label>_error`` (it failed). The record goes to
``--out`` (a folder gets ``lowbit_probe.json``; default ``bench/results/<gpu>/``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import Record, alternate, call_ms, cli, markdown_table, median, sync

import fxopt.quant  # noqa: F401  (registers torch.ops.fxopt_quant)
from fxopt.quant import int8_mm

D, HIDDEN = 4096, 11008
SHAPES = {"gate+up": (2 * HIDDEN, D), "down": (D, HIDDEN)}
#: ``--smoke``: the same two layers' proportions, tiny (K a multiple of int4's group 128)
SMOKE_SHAPES = {"gate+up": (256, 128), "down": (128, 256)}
SMOKE_MS = "1,32"
L2_BYTES = 60 * 2**20
INT4_GROUP = 128
#: routes a CPU cannot run, and why
CUDA_ONLY = {"two_term": "CUDA only (Triton kernels)", "dequant_cublas": "CUDA only (a Triton kernel, then cuBLAS)",
             "int4_tinygemm": "CUDA only (tinygemm's int4 packing)"}
#: the columns of the printed table
COLUMNS = ["bf16", "wo_triton", "two_term", "dequant_cublas", "w8a8_triton", "fp8_rowwise", "int4_tinygemm",
           "int4_fxopt", "gemlite_a16w8"]


class Weights:
    """One layer's weights in every format, ``copies`` of each (distinct: none stays in L2)."""

    def __init__(self, n: int, k: int, copies: int, device: torch.device):
        self.copies = copies
        self.w16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        self.ws = [(w.float().abs().amax(1) / 127).clamp(min=1e-12) for w in self.w16]
        self.w8 = [torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8) for w, s in zip(self.w16, self.ws)]
        self.w8t = [w.t() for w in self.w8]  # [K, N] views: _int_mm's second operand, column-major
        self.w8f = [w.to(torch.float8_e4m3fn) for w in self.w8]  # stand-in fp8 weights (timing only)
        self.fx4 = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device) for _ in range(copies)]
        self.fx4s = torch.rand(n, k // INT4_GROUP, device=device) / 100
        self.w4: list[torch.Tensor] = []
        if device.type == "cuda":
            self.w4 = [torch._convert_weight_to_int4pack(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8,
                                                                       device=device), 8) for _ in range(copies)]
        self.sz4 = torch.rand(k // INT4_GROUP, n, 2, device=device, dtype=torch.bfloat16)
        self.gemlite: list[Callable] = []


def pack_gemlite(gemlite: Callable | None, w: Weights) -> str | None:
    """``w.gemlite``: gemlite's packing of the int8 weights; why there is none, or None."""
    if gemlite is None:
        return None
    try:
        w.gemlite = [gemlite(device=str(v.device), dtype=torch.bfloat16).from_weights(
            v, scales=s[:, None].to(torch.bfloat16)) for v, s in zip(w.w8, w.ws)]
    except Exception as exc:  # noqa: BLE001 - an optional comparison: the row says why
        return f"gemlite pack failed: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``'s per-row int8 quantization: the int8 rows, their scales, and the rounding residual."""
    s = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 127
    q = torch.round(x.float() / s).clamp(-127, 127)
    return q.to(torch.int8), s, (x.float() - q * s)


def routes(x: torch.Tensor, w: Weights) -> dict[str, Callable[[], Any]]:
    """Each route's call over every copy of the weights, for the activation ``x`` (``[M, K]``)."""
    ops = torch.ops.fxopt_quant
    pairs = list(zip(w.w8, w.ws))
    calls: dict[str, Callable[[], Any]] = {
        "bf16": lambda: [F.linear(x, v) for v in w.w16],
        "two_term": lambda: [int8_mm.two_term_linear(x, v, s, None) for v, s in pairs],
        "dequant_cublas": lambda: [int8_mm.dequantized_linear(x, v, s, None) for v, s in pairs],
        "wo_triton": lambda: [ops.int8_weight_only_linear(x, v, s, None) for v, s in pairs],
        "wo_reference": lambda: [F.linear(x, v.to(torch.bfloat16) * s[:, None].to(torch.bfloat16)) for v, s in pairs],
    }
    m, n = x.shape[0], w.w16[0].shape[0]
    if m > 16:  # torch._int_mm needs more than 16 rows
        xq, xs, res = per_token(x)
        rs = res.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        x2 = torch.cat([xq, torch.round(res / rs).clamp(-127, 127).to(torch.int8)])
        acc = torch._int_mm(xq, w.w8t[0])
        calls.update({
            "int_mm": lambda: [torch._int_mm(xq, v) for v in w.w8t],
            "int_mm_2m": lambda: [torch._int_mm(x2, v) for v in w.w8t],
            "rescale": lambda: [(acc.float() * xs * s).to(torch.bfloat16) for s in w.ws],
            "quant_rows": lambda: [ops.quantize_per_token(x) for _ in range(w.copies)],
            "w8a8_triton": lambda: [ops.int8_scaled_mm(xq, v, xs, s, None, torch.bfloat16) for v, s in pairs],
            "w8a8_triton_2m": lambda: [ops.int8_scaled_mm(x2, v, torch.cat([xs, rs]), s, None, torch.bfloat16)
                                       for v, s in pairs],
        })
    if m % 16 == 0 or m > 16:
        xf, one_m, one_n = x.to(torch.float8_e4m3fn), torch.ones(m, 1, device=x.device), torch.ones(1, n, device=x.device)
        calls["fp8_rowwise"] = lambda: [torch._scaled_mm(xf, v.t(), one_m, one_n, out_dtype=torch.bfloat16)
                                        for v in w.w8f]
    calls["int4_tinygemm"] = lambda: [torch._weight_int4pack_mm(x, v, INT4_GROUP, w.sz4) for v in w.w4]
    calls["int4_fxopt"] = lambda: [ops.int4_weight_only_linear(x, v, w.fx4s, INT4_GROUP, None) for v in w.fx4]
    calls["gemlite_a16w8"] = lambda: [g(x) for g in w.gemlite]
    return calls


def skipped(label: str, device: torch.device, gemlite_why: str | None) -> str | None:
    """Why ``label`` cannot run here, or None."""
    if device.type != "cuda" and label in CUDA_ONLY:
        return CUDA_ONLY[label]
    if label == "gemlite_a16w8" and gemlite_why:
        return gemlite_why
    return None


def measure_row(row: dict[str, Any], calls: dict[str, Callable[[], Any]], copies: int, device: torch.device,
                rounds: int, gemlite_why: str | None) -> None:
    """Each route's us per call into ``row`` (interleaved rounds); None with the reason for one
    that cannot run here or fails."""
    live = {}
    for label, fn in calls.items():
        why = skipped(label, device, gemlite_why)
        if why:
            row[label], row[f"{label}_skipped"] = None, why
            continue
        try:
            fn()  # compiles Triton's kernels, outside any CUDA-graph capture
            sync(device)
            live[label] = fn
        except Exception as exc:  # noqa: BLE001 - a route that fails here is a finding
            row[label], row[f"{label}_error"] = None, f"{type(exc).__name__}: {str(exc)[:200]}"

    def failed(label: str, exc: BaseException) -> None:
        row[label], row[f"{label}_error"] = None, f"{type(exc).__name__}: {str(exc)[:200]}"

    cuda = device.type == "cuda"
    samples = alternate(live, rounds, lambda fn: call_ms(fn, device.type, graph=cuda) * 1e3 / copies,
                        on_error=failed, reverse_odd=True)
    row.update({label: round(median(times), 2) for label, times in samples.items()})


def load_gemlite(wanted: bool) -> tuple[Callable | None, str | None]:
    """gemlite's A16W8 int8 class, or why there is none."""
    if not wanted:
        return None, "--no-gemlite"
    try:
        from gemlite.helper import A16W8_INT8
    except Exception as exc:  # noqa: BLE001 - an optional comparison: the row says why
        return None, f"gemlite does not import: {type(exc).__name__}: {exc}"[:200]
    return A16W8_INT8, None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.splitlines()[0], rounds=1)
    parser.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    parser.add_argument("--no-gemlite", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated labels to time (default: all)")
    args = parser.parse_args(argv)
    device = torch.device(cli.device_for(args))
    shapes, ms = (SMOKE_SHAPES, SMOKE_MS) if args.smoke else (SHAPES, args.ms)
    record = Record("lowbit_probe", args, device.type, unit="us per call")
    gemlite, gemlite_why = load_gemlite(not args.no_gemlite)
    record.extra["gemlite"] = gemlite_why or "imported"
    torch.manual_seed(0)
    for name, (n, k) in shapes.items():
        copies = max(1, math.ceil(3 * L2_BYTES / (n * k))) if device.type == "cuda" else 1
        weights = Weights(n, k, copies, device)
        no_gemlite = gemlite_why or pack_gemlite(gemlite, weights)
        for m in map(int, ms.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            calls = routes(x, weights)
            if args.only:
                calls = {label: fn for label, fn in calls.items() if label in args.only.split(",")}
            row = {"shape": name, "N": n, "K": k, "M": m, "copies": copies}
            measure_row(row, calls, copies, device, args.rounds, no_gemlite)
            record.add(row)
            print(f"{name} M={m}: " + ", ".join(f"{c} {row[c]}" for c in COLUMNS if c in row), flush=True)
    print(markdown_table(record.rows, ["shape", "M", *COLUMNS], digits=2))
    return record.data


if __name__ == "__main__":
    main()
