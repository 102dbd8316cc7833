"""Time of ``fxopt.optimize`` with the full pass list on the real-model sweep, and the
first ``optimize`` of a process.

For each model of ``bench/real_models.py`` (random weights, small inputs) and capture
path, eval mode: the seconds ``fxopt.optimize(gm, FULL, example_inputs)`` takes, best of
``--repeat`` fresh copies of the captured graph, in a process that has already run one
optimize (the first one of a process is timed separately, in fresh interpreters: the
demo model through the same pass list, imports included). Wall seconds
(``time.perf_counter``) and the process's CPU seconds (``time.process_time``: steadier on
a shared machine; above the wall time where torch's kernels use both cores); take the
best of several runs and record the load.

    python bench/optimize_time.py [--models convnext_tiny,densenet121] [--paths export]
                                  [--repeat 3] [--first 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

import fxopt
from fxopt.models import demo_model

sys.path.insert(0, str(Path(__file__).parent))
import real_models  # noqa: E402

FULL = ["constant_fold", "cse", "dce", "eliminate_identity", "fold_conv_bn", "fuse_conv_bn_relu",
        "fuse_add_relu", "fuse_linear_relu", "inplace", "plan_memory"]

FIRST = f"""
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import fxopt
from fxopt.models import demo_model
from fxopt.models import demo_model
model, inputs = demo_model()
gm = torch.fx.symbolic_trace(model)
t2 = time.perf_counter()
fxopt.optimize(gm, {FULL!r}, example_inputs=inputs)
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2)
"""


def first_optimize(repeat: int) -> list[tuple[float, float, float]]:
    """(import torch, import fxopt + demo model, first optimize) seconds, per fresh process."""
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", FIRST], capture_output=True, text=True, check=True)
        runs.append(tuple(float(x) for x in out.stdout.split()))
    return runs


def time_model(name: str, path: str, repeat: int) -> dict:
    model, inputs = real_models.MODELS[name]()
    model.eval()
    record: dict = {"model": name, "path": path}
    try:
        gm, call_inputs = real_models.capture(path, copy.deepcopy(model), inputs)
    except Exception as exc:  # torch's capture failed: not timed
        record["capture"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        return record
    times, cpu, passes = [], [], None
    for _ in range(repeat):
        g = copy.deepcopy(gm)
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fxopt.optimize(g, FULL, example_inputs=call_inputs)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if passes is None or times[-1] == min(times):
            passes = {r.name: round(r.seconds, 4) for r in fxopt.report_of(out).records}
    record.update(nodes=len(gm.graph.nodes), seconds=min(times), cpu_seconds=min(cpu),
                  all=[round(t, 4) for t in times], passes=passes)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(real_models.MODELS))
    parser.add_argument("--paths", default=",".join(real_models.PATHS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--first", type=int, default=5, help="fresh processes for the first optimize")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"# {os.uname().nodename}, {os.cpu_count()} CPUs, load {os.getloadavg()}, torch {torch.__version__}")
    result: dict = {"torch": torch.__version__, "load_before": os.getloadavg()}
    if args.first:
        runs = first_optimize(args.first)
        result["first"] = runs
        best = min(runs, key=lambda r: r[2])
        print(f"first optimize of a process (demo model, full list), best of {args.first}: "
              f"{best[2]:.3f} s (import torch {best[0]:.2f} s, import fxopt + model {best[1]:.2f} s); "
              f"all: {', '.join(f'{r[2]:.2f}' for r in runs)}", flush=True)
    with real_models._tolerant_torchvision_import():
        import torchvision  # noqa: F401 - timm and transformers import it lazily
    model, inputs = demo_model()
    fxopt.optimize(torch.fx.symbolic_trace(model), FULL, example_inputs=inputs)  # the first one
    records = []
    for name in args.models.split(","):
        for path in args.paths.split(","):
            r = time_model(name, path, args.repeat)
            records.append(r)
            if "capture" in r:
                print(f"{name:28s} {path:15s} capture failed: {r['capture'][:70]}", flush=True)
                continue
            slow = sorted(r["passes"].items(), key=lambda kv: -kv[1])[:3]
            print(f"{name:28s} {path:15s} nodes={r['nodes']:5d} {r['seconds']:6.3f} s "
                  f"(CPU {r['cpu_seconds']:6.3f} s) "
                  f"{'OVER 1 s ' if r['seconds'] > 1 else ''}| slowest: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in slow), flush=True)
    timed = [r for r in records if "seconds" in r]
    worst = max(timed, key=lambda r: r["seconds"])
    print(f"worst: {worst['model']} {worst['path']} {worst['seconds']:.3f} s; over 1 s: "
          f"{sum(r['seconds'] > 1 for r in timed)} of {len(timed)}; load after {os.getloadavg()}")
    result.update(records=records, load_after=os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
