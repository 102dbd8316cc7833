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
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import fxopt
t2 = time.perf_counter()
out = {"import torch": t1 - t0, "import fxopt after torch": t2 - t1}
if MODE == "lookup":
    t = time.perf_counter(); fxopt.get_pass_class("dce"); out["get_pass_class('dce')"] = time.perf_counter() - t
    t = time.perf_counter(); fxopt.PassManager(list(fxopt.DEFAULT_PIPELINE))
    out["PassManager(DEFAULT_PIPELINE), not run"] = time.perf_counter() - t
    t = time.perf_counter(); fxopt.registered_passes(); out["registered_passes() (all modules)"] = time.perf_counter() - t
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
    t = time.perf_counter(); fxopt.optimize(gm, ["plan_memory"], example_inputs=inputs)
    label = MODE + (": first plan_memory after a first optimize" if WARM else
                    ": first optimize(['plan_memory']) in the process")
    out[label] = time.perf_counter() - t
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
    print(f"median of {args.repeats} fresh processes (python {sys.version.split()[0]})")
    for key, values in samples.items():
        if isinstance(values[0], bool):
            print(f"  {key:48s} {all(values)}")
        else:
            print(f"  {key:48s} {statistics.median(values) * 1e3:8.1f} ms   "
                  f"(min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})")


if __name__ == "__main__":
    main()
