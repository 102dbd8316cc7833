"""Tune the int8 weight-only kernels for the Llama MLP's layers and write the shipped table.

    python3 bench/int8_tune.py --out $OUT          # needs a CUDA GPU; about 4-6 minutes on an H100

For every M of ``--ms`` and every layer of ``--shapes`` (``swiglu``: the merged gate/up weight
``[2 x 11008, 4096]`` with SwiGLU fused, what ``quantize_model`` + ``fuse_swiglu`` serve;
``down``: ``[4096, 11008]``; ``gate``: ``[11008, 4096]``, an unmerged gate or up projection),
every candidate of ``fxopt.quant.int8_configs.candidates`` (both GEMM orientations, the GEMV,
the reference) is checked against a float32 reference (the dequantized weight, float32
matmul: SQNR >= 40 dB, else it is dropped) and timed against cuBLAS bf16 (``F.linear`` on
the bf16 weight; for ``swiglu`` followed by ``silu(gate) * up``, as eager bf16 runs it).

Timing: ``triton.testing.do_bench`` (CUDA events, median; it flushes L2 before every rep by
writing a 256 MB buffer, so the weight comes from HBM as in a stack of layers), short reps for
every candidate, then the four best of each (M bucket, layer) again with longer reps. The
reference candidate is timed as Inductor runs it under ``torch.compile``: one pointwise kernel
(``torch.mul(w, scale, out=bf16 weight)``), then cuBLAS.

Several M values share a bucket (``int8_configs.m_bucket``: 32 and 64 -> 64; 128 and 256 ->
256; 512 .. 4096 -> the large bucket): the winner of a bucket is the candidate whose worst
ratio to bf16 over its M values is best. Triton compiles every candidate first in parallel
worker processes (``--workers``) that fill Triton's on-disk cache; this process then loads them.

Writes ``$OUT/int8_tune.json`` (every time, every ratio, the winners) and
``$OUT/int8_defaults.json``: the shipped table (``fxopt/quant/int8_defaults.json``) with this
run's winners added or replacing those of the same key (``sm90|bucket|N|K|torch.bfloat16|False|
None|gated``), ready to copy over the shipped file. ``--budget-s`` stops timing new M values
once it is spent; buckets with an M left untimed are not written.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from int8_defaults_from_cache import TABLE, merge  # bench/ is on sys.path when run as a script
from torch._library.triton import set_wrap_triton_enabled

from fxopt.quant import int8_configs, tuning_cache
from fxopt.quant.accuracy import sqnr

D, HIDDEN = 4096, 11008
#: layer -> (weight rows, K, gated)
SHAPES = {"swiglu": (2 * HIDDEN, D, True), "down": (D, HIDDEN, False), "gate": (HIDDEN, D, False)}
#: large M first (the buckets this tuner was written for), decode last (tuned before)
MS = [512, 1024, 2048, 4096, 32, 64, 128, 256, 1, 16]
DTYPE = torch.bfloat16
MIN_SQNR = 40.0
DEVICE = "cuda"


def log(*args) -> None:
    print(*args, flush=True)


def operands(m: int, rows: int, k: int) -> tuple[torch.Tensor, ...]:
    """Random ``(x, w int8, scale, y)`` of one layer, as the tuner in the library makes them."""
    gen = torch.Generator(device=DEVICE).manual_seed(m * 7 + rows + k)
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=gen)
    w = torch.randint(-127, 128, (rows, k), device=DEVICE, dtype=torch.int8, generator=gen)
    scale = torch.rand(rows, device=DEVICE, generator=gen) / 127 / 16
    return x, w, scale


def run(candidate, x, w, scale, gated: bool, y: torch.Tensor, wbuf: torch.Tensor | None) -> torch.Tensor:
    """One call of ``candidate``; the reference as Inductor compiles it (one pointwise kernel
    dequantizes into ``wbuf``, then cuBLAS)."""
    from fxopt.quant import triton_kernels

    if candidate[0] != int8_configs.REFERENCE:
        return triton_kernels.launch(candidate, x, w, scale, None, y, gated)
    torch.mul(w, scale[:, None], out=wbuf)
    out = F.linear(x, wbuf)
    if gated:
        gate, up = out.chunk(2, dim=-1)
        return F.silu(gate) * up
    return out


def compile_key(m: int, shape: str, candidate) -> tuple:
    """What Triton compiles a launch for: the configuration, the layer's form, and M's
    specialization (M = 1 is a constant to Triton; every other tuned M is a multiple of 16)."""
    return candidate, SHAPES[shape][2], m == 1


def _compile(jobs: list[tuple[int, str, tuple]]) -> list[str]:
    """Worker process: launch each job once (Triton compiles it into its on-disk cache),
    holding one layer's operands at a time."""
    torch.cuda.set_device(0)
    errors, current, made = [], None, ()
    for m, shape, candidate in sorted(jobs, key=lambda job: (job[0], job[1])):
        rows, k, gated = SHAPES[shape]
        if current != (m, shape):
            current, made = (m, shape), ()
            x, w, scale = operands(m, rows, k)
            made = (x, w, scale, torch.empty(m, rows // 2 if gated else rows, device=DEVICE, dtype=DTYPE))
        x, w, scale, y = made
        try:
            with set_wrap_triton_enabled(False):
                run(candidate, x, w, scale, gated, y, None)
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a result
            errors.append(f"{shape} M={m} {candidate}: {type(exc).__name__}: {str(exc)[:200]}")
    torch.cuda.synchronize()
    return errors


def precompile(ms: list[int], shapes: list[str], workers: int) -> list[str]:
    """Compile every distinct launch once, spread over ``workers`` processes."""
    seen = {}
    for m in ms:
        for shape in shapes:
            for candidate in int8_configs.candidates(int8_configs.m_bucket(m), gated=SHAPES[shape][2]):
                if candidate[0] != int8_configs.REFERENCE:
                    seen.setdefault(compile_key(m, shape, candidate), (m, shape, candidate))
    jobs = list(seen.values())
    chunks = [jobs[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        errors = [e for found in pool.map(_compile, chunks) for e in found]
    log(f"compiled {len(jobs)} launches in {workers} processes; {len(errors)} failed")
    return errors


def time_ms(fn, rep: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=rep, return_mode="median")


def tune_one(m: int, shape: str, rep: int) -> dict:
    """Every candidate's check and time for one (M, layer), and bf16's."""
    rows, k, gated = SHAPES[shape]
    n = rows // 2 if gated else rows
    x, w, scale = operands(m, rows, k)
    y = torch.empty(m, n, device=DEVICE, dtype=DTYPE)
    wbuf = torch.empty(rows, k, device=DEVICE, dtype=DTYPE)
    wf = w.float() * scale[:, None]
    full = x.float() @ wf.t()
    ref = F.silu(full[:, :n]) * full[:, n:] if gated else full
    w16 = wf.to(DTYPE)
    del wf, full

    def bf16():
        out = F.linear(x, w16)
        if gated:
            gate, up = out.chunk(2, dim=-1)
            return F.silu(gate) * up
        return out

    row = {"M": m, "shape": shape, "rows": rows, "K": k, "gated": gated, "bucket": int8_configs.m_bucket(m),
           "bf16_ms": time_ms(bf16, 4 * rep), "candidates": []}
    for candidate in int8_configs.candidates(row["bucket"], gated=gated):
        entry = {"kernel": candidate[0], "config": int8_configs.as_fields(candidate[1])}
        try:
            quality = sqnr(ref, run(candidate, x, w, scale, gated, y, wbuf))
            entry["sqnr_db"] = round(quality, 2)
            if quality >= MIN_SQNR:
                entry["ms"] = time_ms(lambda c=candidate: run(c, x, w, scale, gated, y, wbuf), rep)
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        row["candidates"].append(entry)
    timed = sorted((c for c in row["candidates"] if "ms" in c), key=lambda c: c["ms"])
    for entry in timed[:4]:  # the finalists, again with longer reps
        candidate = (entry["kernel"], int8_configs.Config(**entry["config"]) if entry["config"] else None)
        entry["ms"] = time_ms(lambda c=candidate: run(c, x, w, scale, gated, y, wbuf), 4 * rep)
    best = min(timed[:4], key=lambda c: c["ms"]) if timed else None
    row["best"] = best and {**best, "vs_bf16": round(row["bf16_ms"] / best["ms"], 3)}
    reference = next((c for c in row["candidates"] if c["kernel"] == int8_configs.REFERENCE), {})
    if "ms" in reference:
        row["reference_vs_bf16"] = round(row["bf16_ms"] / reference["ms"], 3)
    log(f"{shape:6} M={m:5}: bf16 {row['bf16_ms'] * 1e3:8.1f} us; best {best and best['kernel']} "
        f"{best and best['config']} {best and best['ms'] * 1e3:.1f} us = {row['best'] and row['best']['vs_bf16']}x "
        f"(reference {row.get('reference_vs_bf16')}x); {len(timed)} of {len(row['candidates'])} ran")
    return row


def winners(rows: list[dict], ms: list[int], family: str) -> dict[str, list]:
    """Per (bucket, layer): the candidate with the best worst ratio to bf16 over the bucket's
    tuned M values, where every one of them was timed."""
    table = {}
    by_key: dict[tuple, list[dict]] = {}
    for row in rows:
        by_key.setdefault((row["bucket"], row["shape"]), []).append(row)
    for (bucket, shape), group in sorted(by_key.items()):
        wanted = {m for m in ms if int8_configs.m_bucket(m) == bucket}
        if {row["M"] for row in group} != wanted:
            log(f"bucket {bucket} {shape}: M {sorted(wanted - {r['M'] for r in group})} not timed, not written")
            continue
        worst: dict[str, float] = {}
        for row in group:
            for c in row["candidates"]:
                key = json.dumps([c["kernel"], c["config"]], sort_keys=True)
                ratio = c["ms"] / row["bf16_ms"] if "ms" in c else float("inf")
                worst[key] = max(worst.get(key, 0.0), ratio)
        best = min(worst, key=worst.get)
        if worst[best] == float("inf"):
            continue
        rows_, k, gated = SHAPES[shape]
        tuning_key = (bucket, rows_, k, DTYPE, False, None, gated)
        table[tuning_cache.entry_key(family, tuning_key)] = json.loads(best)
        log(f"bucket {bucket:5} {shape:6}: {best} worst ratio to bf16 {1 / worst[best]:.3f}x")
    return table


def large_m_by_shape(rows: list[dict]) -> str | None:
    """What ``int8_configs.LARGE_M_BY_SHAPE`` should be after this run: "gemm" where fxopt's
    fastest GEMM beat the reference at every timed M above 256 rows, else the reference."""
    large = [row for row in rows if row["M"] > int8_configs.M_BUCKETS[-1]]
    if not large:
        return None
    ratios = []
    for row in large:
        timed = [c for c in row["candidates"] if "ms" in c]
        reference = min((c["ms"] for c in timed if c["kernel"] == int8_configs.REFERENCE), default=float("inf"))
        gemm = min((c["ms"] for c in timed if c["kernel"] == "gemm"), default=float("inf"))
        ratios.append(reference / gemm)
        log(f"{row['shape']:6} M={row['M']:5}: fxopt GEMM {ratios[-1]:.3f}x the reference's speed")
    choice = "gemm" if min(ratios) >= 1 else int8_configs.REFERENCE
    log(f"int8_configs.LARGE_M_BY_SHAPE should be {choice!r}")
    return choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rep", type=int, default=25, help="do_bench's rep (ms) per candidate")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--budget-s", type=float, default=330.0)
    args = parser.parse_args()
    start = time.perf_counter()
    ms = [int(m) for m in args.ms.split(",")]
    shapes = args.shapes.split(",")
    import triton

    family = int8_configs.gpu_family(torch.cuda.get_device_capability())
    result = {"device": torch.cuda.get_device_name(), "family": family, "torch": torch.__version__,
              "triton": triton.__version__, "ms": ms, "shapes": shapes, "rows": []}
    result["compile_errors"] = precompile(ms, shapes, args.workers)
    result["compile_s"] = round(time.perf_counter() - start, 1)
    timed_ms = []
    # the kernels launched directly, as the library's own tuner times them (no operator
    # dispatch of torch.library.wrap_triton around each launch)
    with set_wrap_triton_enabled(False):
        for m in ms:
            if time.perf_counter() - start > args.budget_s:
                log(f"budget of {args.budget_s} s spent: M={m} and after not timed")
                break
            for shape in shapes:
                result["rows"].append(tune_one(m, shape, args.rep))
            timed_ms.append(m)
            torch.cuda.empty_cache()
    entries = winners(result["rows"], ms, family)
    result["large_m_by_shape"] = large_m_by_shape(result["rows"])
    result["winners"] = entries
    result["total_s"] = round(time.perf_counter() - start, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int8_tune.json").write_text(json.dumps(result, indent=1))
    table = json.loads(TABLE.read_text())
    note = (f"{family}: {len(entries)} entries from bench/int8_tune.py (M {','.join(map(str, timed_ms))}; "
            f"shapes {','.join(shapes)}) on {result['device']}, triton {triton.__version__}, torch {torch.__version__}")
    (out / "int8_defaults.json").write_text(json.dumps(merge(table, entries, note), indent=1, sort_keys=True) + "\n")
    log(f"wrote {out / 'int8_tune.json'} and {out / 'int8_defaults.json'} ({note}); {result['total_s']} s")


if __name__ == "__main__":
    main()
