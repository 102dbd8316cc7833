"""Start-up costs, each measured in fresh interpreters (median of --repeats):

- ``import fxopt`` after ``import torch`` (what fxopt adds), and ``import torch`` itself;
- looking a pass up by name (``get_pass_class("dce")``), building a pipeline of the
  default passes without running it, and ``registered_passes()`` (every pass module);
- the first ``plan_memory`` on the demo model (25 nodes, 18 buffers): the whole first
  ``optimize(..., ["plan_memory"], example_inputs)`` of a process, which includes torch's
  first FakeTensor run (shape propagation: any first optimize with inputs pays it), and the
  first ``plan_memory`` after one optimize without passes has paid that; the latter also
  with the numba solver forced (``PYTHON_GREEDY_MAX = 0``, loaded from numba's disk cache),
  to show what the pure-Python greedy for small problems saves.

Each figure is given as wall time and as the process's CPU time: on a shared, loaded
machine the CPU time is the steadier of the two.

    python bench/startup.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from fxopt.progress import progress

PROBE = r"""
import json, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
since = lambda t: [time.perf_counter() - t[0], time.process_time() - t[1]]
t0 = clock()
import torch
t1 = clock()
import fxopt
out = {"import torch": since(t0), "import fxopt after torch": since(t1)}
if MODE == "lookup":
    t = clock(); fxopt.get_pass_class("dce"); out["get_pass_class('dce')"] = since(t)
    t = clock(); fxopt.PassManager(list(fxopt.DEFAULT_PIPELINE))
    out["PassManager(DEFAULT_PIPELINE), not run"] = since(t)
    t = clock(); fxopt.registered_passes(); out["registered_passes() (all modules)"] = since(t)
    out["torch._inductor imported"] = "torch._inductor" in sys.modules
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


def run(mode: str, warm: bool = False) -> dict:
    code = f"MODE = {mode!r}\nWARM = {warm!r}\n" + PROBE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    samples: dict[str, list] = {}
    for _ in progress(range(args.repeats), desc="repeats", unit="repeat"):
        for mode, warm in (("lookup", False), ("plan-python", False), ("plan-python", True),
                           ("plan-numba", True)):  # interleaved: load drifts alike
            for key, value in run(mode, warm).items():
                samples.setdefault(key, []).append(value)
    print(f"median of {args.repeats} fresh processes (python {sys.version.split()[0]}); "
          "wall ms (min-max) | CPU ms of the process (min-max)")
    for key, values in samples.items():
        if isinstance(values[0], bool):
            print(f"  {key:58s} {all(values)}")
            continue
        cells = []
        for column in zip(*values):
            ms = [v * 1e3 for v in column]
            cells.append(f"{statistics.median(ms):7.1f} ({min(ms):.0f}-{max(ms):.0f})")
        print(f"  {key:58s} " + " | ".join(cells))

if __name__ == "__main__":
    main()
