"""Diagnostic: where does ViT lose under the fxopt backend (CUDA-graph timing)?

Times vit_b_16 (bf16, batch 32, H100) under Inductor's own freezing and under the fxopt
backend with subsets of the default pipeline (none at all, without ``constant_fold``,
without ``eliminate_identity``, all), launch-bound and as CUDA-graph replays.

    python3 bench/vit_freezing_probe.py
"""

import importlib.util
import pathlib

import torch

import fxopt

spec = importlib.util.spec_from_file_location("gpu_zoo", pathlib.Path(__file__).with_name("gpu_zoo.py"))
zoo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zoo)


def main() -> None:
    model, (x,) = zoo.build("vit_b_16", False)
    model, x = model.cuda().to(torch.bfloat16), x.cuda().to(torch.bfloat16)
    full = list(fxopt.DEFAULT_PIPELINE)
    pipelines = {"fxopt_none": [], "fxopt_no_constant_fold": [p for p in full if p != "constant_fold"],
                 "fxopt_no_identity": [p for p in full if p != "eliminate_identity"], "fxopt": full}
    results = {}
    with torch.no_grad():
        with torch._inductor.config.patch(freezing=True):
            frozen = torch.compile(model)
            frozen(x)
            results["freezing"] = frozen
        for label, passes in pipelines.items():
            compiled = torch.compile(model, backend="fxopt", options={"passes": passes})
            compiled(x)
            results[label] = compiled
        for label, fn in results.items():
            with torch._inductor.config.patch(freezing=True):
                launch = zoo.bench_ms(fn, (x,), "cuda")
                graph = zoo.bench_ms(fn, (x,), "cuda", graph=True)
            print(f"{label:24s} launch {launch:.3f} ms  graph {graph:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
