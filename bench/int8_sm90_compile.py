"""Compile the int8 GEMM's candidates for an H100 (sm90) without a GPU, and say what each became.

    python3 bench/int8_sm90_compile.py [--bucket 4096] [--out FILE]     # CPU only; needs triton

For every ``_gemm`` candidate of the M bucket (``fxopt.quant.int8_configs.candidates``,
bf16 activations, plain and gated), Triton compiles the kernel ahead of time for sm90 with
the specialization a real launch gets (16-byte aligned pointers, strides and N, K multiples
of 16), and Triton's own ptxas reports registers and spills. From the PTX: shared memory,
the pipelined loads (``cp.async``), and the depth of the ``wgmma.wait_group`` waits in the
main loop: 0 means each tensor-core instruction is waited for before the next tile is
converted (no overlap). What it found with Triton 3.6 (the GPU machine's) is in
``fxopt/quant/int8_configs.py`` (``_GEMM_NORMAL``, ``MAX_ACC_PER_THREAD``): the normal
orientation waits for every wgmma, swap-AB keeps several in flight, and gated tiles over 128
accumulators per thread spill. To reproduce it where the installed Triton is another: in a
venv with only ``pip install --no-deps triton==3.6.0``, run this script with ``--site`` naming
the site-packages of an environment with torch and fxopt (added after the venv's own, so its
Triton comes first).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import site
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16", "p_ptr": "*fp32",
             "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
#: arguments a launch specializes as multiples of 16 (M is left general: any row count)
ALIGNED = [i for i, name in enumerate(SIGNATURE) if name != "M"]


def ptxas() -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(path):
        raise SystemExit(f"no ptxas at {path}: this triton has no NVIDIA backend")
    return path


def compiled(config, gated: bool) -> dict:
    """What ``_gemm`` with ``config`` (an ``int8_configs.Config``) becomes for sm90."""
    from fxopt.quant.triton_kernels import _gemm

    constants = {"HAS_BIAS": False, "PRECISION": "tf32", "BLOCK_N": config.block_n, "BLOCK_M": config.block_m,
                 "BLOCK_K": config.block_k, "GROUP_N": 8, "SPLIT_K": config.split_k, "FAST_CVT": config.fast_cvt,
                 "GATED": gated, "SWAP_AB": config.swap_ab}
    signature = {**SIGNATURE, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=_gemm, signature=signature, constexprs=constants,
                       attrs={(i,): [["tt.divisibility", 16]] for i in ALIGNED})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        report = subprocess.run([ptxas(), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"shared_kb": kernel.metadata.shared // 1024, "registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "wgmma_waits": sorted({int(d) for d in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket", type=int, default=4096, help="an M bucket (default: above 256 rows)")
    parser.add_argument("--site", default=None, help="a site-packages with torch and fxopt, added last")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.site:
        site.addsitedir(args.site)  # its .pth files too: fxopt's editable install
    from fxopt.quant import int8_configs

    rows = []
    for gated in (False, True):
        for _, config in int8_configs.candidates(args.bucket, "gemm", gated):
            if config.fast_cvt == 0 or config.split_k != 1:
                continue  # the same tiles: the conversion and the split change no pipelining
            row = {"gated": gated, "config": int8_configs.as_fields(config)}
            try:
                row.update(compiled(config, gated))
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            tile = (f"{'swap-AB' if config.swap_ab else 'normal '} {'gated' if gated else 'plain'} "
                    f"M{config.block_m} N{config.block_n} K{config.block_k} w{config.num_warps} s{config.num_stages}")
            print(f"{tile:42} " + ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("gated", "config")),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "bucket": args.bucket, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
