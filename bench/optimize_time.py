"""Time of ``fxopt.optimize`` with the full pass list on the real-model sweep.

For each model of ``bench/real_models.py`` (random weights, small inputs) and capture
path, eval mode: the seconds ``fxopt.optimize(gm, FULL, example_inputs)`` takes (the full
pass list of ``bench/pass_growth.py``), best of ``--repeat`` fresh copies of the captured
graph, in a process that has already run one optimize: the first ``optimize`` of a process
is ``bench/startup.py``'s ``first-optimize`` probe, in fresh interpreters. Wall seconds and
the CPU seconds of the process (the harness's ``clocked``: steadier on a shared machine;
above the wall time where torch's kernels use both cores); take the best of several runs
and record the load. One row per model and path; a capture torch refuses is a row saying why.

    python bench/optimize_time.py [--models convnext_tiny,densenet121] [--paths export]
                                  [--repeat 3] [--out out.json]   # bench/results/cpu/optimize_time.json
    python bench/optimize_time.py --smoke                          # fxopt's demo net, two paths (CI)
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import warnings
from typing import Any

import real_models
import torch
from harness import Record, cli, clocked
from pass_growth import FULL

import fxopt
from fxopt.models import demo_model


def time_model(name: str, path: str, repeat: int) -> dict[str, Any]:
    """One model on one capture path: the best of ``repeat`` optimizes of fresh copies, and
    the passes' seconds in the fastest run."""
    model, inputs = real_models.MODELS[name]()
    model.eval()
    row: dict[str, Any] = {"model": name, "path": path}
    try:
        gm, call_inputs = real_models.capture(path, copy.deepcopy(model), inputs)
    except Exception as exc:  # torch's capture failed: not timed
        row["capture"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        return row
    runs = [clocked(functools.partial(fxopt.optimize, copy.deepcopy(gm), FULL, example_inputs=call_inputs))
            for _ in range(repeat)]
    fastest = min(runs, key=lambda r: r.wall_s)
    row.update(nodes=len(gm.graph.nodes), seconds=fastest.wall_s, cpu_seconds=min(r.cpu_s for r in runs),
               all=[round(r.wall_s, 4) for r in runs],
               passes={r.name: round(r.seconds, 4) for r in fxopt.report_of(fastest.value).records})
    return row


def describe(row: dict[str, Any]) -> str:
    if "capture" in row:
        return f"{row['model']:28s} {row['path']:15s} capture failed: {row['capture'][:70]}"
    slow = sorted(row["passes"].items(), key=lambda kv: -kv[1])[:3]
    return (f"{row['model']:28s} {row['path']:15s} nodes={row['nodes']:5d} {row['seconds']:6.3f} s "
            f"(CPU {row['cpu_seconds']:6.3f} s) {'OVER 1 s ' if row['seconds'] > 1 else ''}| slowest: "
            + ", ".join(f"{k} {v:.3f}" for k, v in slow))


def sweep_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst run, the median and how many took over a second."""
    timed = [r for r in rows if "seconds" in r]
    if not timed:
        return {"timed": 0}
    worst = max(timed, key=lambda r: r["seconds"])
    return {"worst": [worst["model"], worst["path"], worst["seconds"]], "timed": len(timed),
            "median_s": statistics.median(r["seconds"] for r in timed),
            "over_1s": sum(r["seconds"] > 1 for r in timed)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(m for m in real_models.MODELS if m != "fxopt_demo"))
    parser.add_argument("--paths", default=",".join(real_models.PATHS))
    parser.add_argument("--repeat", dest="rounds", type=int, help="the old name of --rounds")
    parser.add_argument("--json", dest="out", help="the old name of --out")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(real_models.SMOKE, rounds=1)
    record = Record("optimize_time", args, "cpu", load_before=os.getloadavg())
    print(f"# {os.uname().nodename}, {record.meta['cores']} cores, load {os.getloadavg()}, torch {torch.__version__}")
    real_models.preload_torchvision()
    model, inputs = demo_model()
    fxopt.optimize(torch.fx.symbolic_trace(model), FULL, example_inputs=inputs)  # the first one, not timed
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        for name in args.models.split(","):
            for path in args.paths.split(","):
                print(describe(record.add(time_model(name, path, args.rounds))), flush=True)
    record.extra.update(summary=sweep_summary(record.rows), load_after=os.getloadavg())
    record.save()
    print(f"summary: {record.extra['summary']}; load after {record.extra['load_after']}")
    return record.data


if __name__ == "__main__":
    main()
