"""Start-up costs, each measured in fresh interpreters (min and median of --repeats):

- ``import fxopt`` after ``import torch`` (what fxopt adds), and ``import torch`` itself;
- looking a pass up by name (``get_pass_class("dce")``), building a pipeline of the
  default passes without running it, and ``registered_passes()`` (every pass module);
- the first ``optimize`` of a process (issue 30, item 4): the demo conv net, the default
  pipeline, ``example_inputs`` given (so shapes are propagated); timed from after
  ``import torch`` and ``import fxopt`` (the model is built and traced outside the timer),
  with the total from after ``import torch``, and whether it imported ``torch._dynamo`` or
  sympy. Then the same with ``torch._dynamo`` imported first (timed on its own), and with
  ``shape_rules=False`` (the FakeTensor route, which a graph without shape rules for all
  its ops takes; skipped on builds that predate the option);
- what any shape propagation costs torch the first time, each in a process of its own:
  ``FakeTensorMode()``, and one elementwise op on meta tensors (``x + x``), with whether it
  imported ``torch._dynamo``;
- the first ``plan_memory`` on the demo model (25 nodes, 18 buffers): the whole first
  ``optimize(..., ["plan_memory"], example_inputs)`` of a process, and the first
  ``plan_memory`` after one optimize without passes has paid torch's first FakeTensor run;
  the latter also with the numba solver forced (``PYTHON_GREEDY_MAX = 0``, loaded from
  numba's disk cache), to show what the pure-Python greedy for small problems saves.

Each figure is given as wall time and as the process's CPU time: on a shared, loaded
machine the CPU time is the steadier of the two, and the minimum the least disturbed.
fxopt's modules are read from their bytecode caches when those exist (as after a pip
install); with ``PYTHONDONTWRITEBYTECODE`` set and no caches they are compiled in every
process (about 40 ms CPU more): the script says which.

    python bench/startup.py --repeats 7                       # every probe
    python bench/startup.py --repeats 9 --probes first-optimize,torch-floor
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import fxopt
from fxopt.progress import progress

PROBE = r"""
import inspect, json, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
since = lambda t: [time.perf_counter() - t[0], time.process_time() - t[1]]
t0 = clock()
import torch
out = {"import torch": since(t0)}
if MODE == "meta-add":
    x = torch.empty(2, device="meta")
    t = clock(); x + x; out["torch: first meta-tensor x + x"] = since(t)
    out["torch: meta x + x imported torch._dynamo"] = "torch._dynamo" in sys.modules
    print(json.dumps(out)); sys.exit()
if MODE == "fake-mode":
    from torch._subclasses.fake_tensor import FakeTensorMode
    t = clock(); FakeTensorMode(); out["torch: first FakeTensorMode()"] = since(t)
    print(json.dumps(out)); sys.exit()
t1 = clock()
import fxopt
out["import fxopt after torch"] = since(t1)
if MODE == "lookup":
    t = clock(); fxopt.get_pass_class("dce"); out["get_pass_class('dce')"] = since(t)
    t = clock(); fxopt.PassManager(list(fxopt.DEFAULT_PIPELINE))
    out["PassManager(DEFAULT_PIPELINE), not run"] = since(t)
    t = clock(); fxopt.registered_passes(); out["registered_passes() (all modules)"] = since(t)
    out["torch._inductor imported"] = "torch._inductor" in sys.modules
elif MODE in ("first", "first-dynamo-paid", "first-fake"):
    from fxopt.models import demo_model
    model, inputs = demo_model()
    gm = torch.fx.symbolic_trace(model)
    label, options = "first optimize(demo, default pipeline)", {}
    if MODE == "first-dynamo-paid":
        t = clock(); import torch._dynamo; out["torch: import torch._dynamo"] = since(t)
        label += ", torch._dynamo imported before"
    if MODE == "first-fake":  # the FakeTensor route, where fxopt's shape rules are not used
        if "shape_rules" not in inspect.signature(fxopt.optimize).parameters:
            print(json.dumps(out)); sys.exit()  # a build without shape rules: "first" is this route
        label, options = label + ", shape_rules=False", {"shape_rules": False}
    t = clock(); fxopt.optimize(gm, example_inputs=inputs, **options); out[label] = since(t)
    if MODE == "first":
        out["import fxopt + first optimize"] = [a + b for a, b in zip(out[label], out["import fxopt after torch"])]
        out["first optimize imported torch._dynamo"] = "torch._dynamo" in sys.modules
        out["first optimize imported sympy"] = "sympy" in sys.modules
else:
    from fxopt.memory import solver
    if MODE == "plan-numba":
        solver.PYTHON_GREEDY_MAX = 0
    from fxopt.models import demo_model
    model, inputs = demo_model()
    if WARM:  # torch's first FakeTensor run done first: what is left is plan_memory's own
        fxopt.optimize(torch.fx.symbolic_trace(model), [], example_inputs=inputs)
    gm = torch.fx.symbolic_trace(model)
    t = clock(); fxopt.optimize(gm, ["plan_memory"], example_inputs=inputs)
    label = MODE + (": first plan_memory after a first optimize" if WARM else
                    ": first optimize(['plan_memory']) in the process")
    out[label] = since(t)
    out[MODE + ": numba imported"] = "numba" in sys.modules
print(json.dumps(out))
"""

#: probe group -> the (mode, warm) runs it takes, each a fresh interpreter
PROBES: dict[str, tuple[tuple[str, bool], ...]] = {
    "lookup": (("lookup", False),),
    "first-optimize": (("first", False), ("first-dynamo-paid", False), ("first-fake", False)),
    "torch-floor": (("fake-mode", False), ("meta-add", False)),
    "plan-memory": (("plan-python", False), ("plan-python", True), ("plan-numba", True)),
}


def run(mode: str, warm: bool = False) -> dict:
    code = f"MODE = {mode!r}\nWARM = {warm!r}\n" + PROBE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def bytecode_cached() -> bool:
    """Whether fxopt's package has a bytecode cache the probes can read."""
    cached = importlib.util.cache_from_source(fxopt.__file__)
    return os.path.exists(cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--probes", default=",".join(PROBES),
                        help=f"comma-separated probe groups (default all: {', '.join(PROBES)})")
    args = parser.parse_args()
    groups = args.probes.split(",")
    unknown = [g for g in groups if g not in PROBES]
    if unknown:
        parser.error(f"unknown probe group(s) {', '.join(unknown)}; known: {', '.join(PROBES)}")
    samples: dict[str, list] = {}
    for _ in progress(range(args.repeats), desc="repeats", unit="repeat"):
        for group in groups:  # interleaved: load drifts alike
            for mode, warm in PROBES[group]:
                for key, value in run(mode, warm).items():
                    samples.setdefault(key, []).append(value)
    print(f"{args.repeats} fresh processes each (python {sys.version.split()[0]}, torch "
          f"{__import__('torch').__version__}, fxopt bytecode cached: {bytecode_cached()}); "
          "wall ms min / median (max) | CPU ms of the process min / median (max)")
    for key, values in samples.items():
        if isinstance(values[0], bool):
            print(f"  {key:66s} {'always' if all(values) else 'never' if not any(values) else 'sometimes'}")
            continue
        cells = []
        for column in zip(*values):
            ms = [v * 1e3 for v in column]
            cells.append(f"{min(ms):7.1f} / {statistics.median(ms):7.1f} ({max(ms):.0f})")
        print(f"  {key:66s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
