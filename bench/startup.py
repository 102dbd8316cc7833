"""Start-up costs, each measured in fresh interpreters (min and median of ``--rounds``):

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

Each probe is this script run again with ``--probe MODE`` (the harness's ``fresh_process``),
the rounds interleaved so that the load drifts alike for every probe. Each figure is given as
wall time and as the process's CPU time: on a shared, loaded machine the CPU time is the
steadier of the two, and the minimum the least disturbed. fxopt's modules are read from their
bytecode caches when those exist (as after a pip install); with ``PYTHONDONTWRITEBYTECODE``
set and no caches they are compiled in every process (about 40 ms CPU more): the record says
which. One row per figure.

    python bench/startup.py --repeats 7                       # every probe
    python bench/startup.py --repeats 9 --probes first-optimize,torch-floor
    python bench/startup.py --smoke                           # the lookup probe, once (CI)
"""

from __future__ import annotations

# The standard library only, at the top: a probe runs this file in a fresh interpreter and
# times `import torch` and `import fxopt` itself (torch imports these modules anyway).
import json
import statistics
import sys
import time
from typing import Any

#: probe group -> the (mode, warm) runs it takes, each a fresh interpreter
PROBES: dict[str, tuple[tuple[str, bool], ...]] = {
    "lookup": (("lookup", False),),
    "first-optimize": (("first", False), ("first-dynamo-paid", False), ("first-fake", False)),
    "torch-floor": (("fake-mode", False), ("meta-add", False)),
    "plan-memory": (("plan-python", False), ("plan-python", True), ("plan-numba", True)),
}
PROBE_TIMEOUT_S = 300.0

Clock = tuple[float, float]


def clock() -> Clock:
    return time.perf_counter(), time.process_time()


def since(start: Clock) -> list[float]:
    """``[wall s, CPU s]`` since ``start``."""
    return [time.perf_counter() - start[0], time.process_time() - start[1]]


# --- the probes: each runs first in a fresh interpreter -----------------------------------

def probe(mode: str, warm: bool) -> dict[str, Any]:
    """``import torch``, then what ``mode`` measures (``warm``: plan_memory after a first optimize)."""
    start = clock()
    import torch  # noqa: F401 - the figure: the process's first import of torch

    out: dict[str, Any] = {"import torch": since(start)}
    if mode in ("meta-add", "fake-mode"):
        return {**out, **torch_floor(mode)}
    start = clock()
    import fxopt

    out["import fxopt after torch"] = since(start)
    if mode == "lookup":
        return {**out, **lookup(fxopt)}
    if mode.startswith("first"):
        return {**out, **first_optimize(mode, fxopt, out["import fxopt after torch"])}
    return {**out, **first_plan_memory(mode, warm, fxopt)}


def torch_floor(mode: str) -> dict[str, Any]:
    """What torch's own first shape propagation costs: a meta-tensor op, or a FakeTensorMode."""
    import torch

    if mode == "meta-add":
        x = torch.empty(2, device="meta")
        start = clock()
        _ = x + x
        return {"torch: first meta-tensor x + x": since(start),
                "torch: meta x + x imported torch._dynamo": "torch._dynamo" in sys.modules}
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = clock()
    FakeTensorMode()
    return {"torch: first FakeTensorMode()": since(start)}


def lookup(fxopt: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    start = clock()
    fxopt.get_pass_class("dce")
    out["get_pass_class('dce')"] = since(start)
    start = clock()
    fxopt.PassManager(list(fxopt.DEFAULT_PIPELINE))
    out["PassManager(DEFAULT_PIPELINE), not run"] = since(start)
    start = clock()
    fxopt.registered_passes()
    out["registered_passes() (all modules)"] = since(start)
    out["torch._inductor imported"] = "torch._inductor" in sys.modules
    return out


def first_optimize(mode: str, fxopt: Any, imported: list[float]) -> dict[str, Any]:
    """The first optimize of the demo net: plain (``first``), after ``import torch._dynamo``
    (``first-dynamo-paid``) or on the FakeTensor route (``first-fake``)."""
    import inspect

    import torch

    from fxopt.models import demo_model

    model, inputs = demo_model()
    gm = torch.fx.symbolic_trace(model)
    out: dict[str, Any] = {}
    label, options = "first optimize(demo, default pipeline)", {}
    if mode == "first-dynamo-paid":
        start = clock()
        import torch._dynamo  # noqa: F401

        out["torch: import torch._dynamo"] = since(start)
        label += ", torch._dynamo imported before"
    if mode == "first-fake":  # the FakeTensor route, where fxopt's shape rules are not used
        if "shape_rules" not in inspect.signature(fxopt.optimize).parameters:
            return out  # a build without shape rules: "first" is this route
        label, options = label + ", shape_rules=False", {"shape_rules": False}
    start = clock()
    fxopt.optimize(gm, example_inputs=inputs, **options)
    out[label] = since(start)
    if mode == "first":
        out["import fxopt + first optimize"] = [a + b for a, b in zip(out[label], imported)]
        out["first optimize imported torch._dynamo"] = "torch._dynamo" in sys.modules
        out["first optimize imported sympy"] = "sympy" in sys.modules
    return out


def first_plan_memory(mode: str, warm: bool, fxopt: Any) -> dict[str, Any]:
    """The first plan_memory of a process (``warm``: after torch's first FakeTensor run),
    by the pure-Python greedy (``plan-python``) or the numba solver (``plan-numba``)."""
    import torch

    from fxopt.memory import solver
    from fxopt.models import demo_model

    if mode == "plan-numba":
        solver.PYTHON_GREEDY_MAX = 0
    model, inputs = demo_model()
    if warm:  # torch's first FakeTensor run done first: what is left is plan_memory's own
        fxopt.optimize(torch.fx.symbolic_trace(model), [], example_inputs=inputs)
    gm = torch.fx.symbolic_trace(model)
    start = clock()
    fxopt.optimize(gm, ["plan_memory"], example_inputs=inputs)
    label = mode + (": first plan_memory after a first optimize" if warm else
                    ": first optimize(['plan_memory']) in the process")
    return {label: since(start), mode + ": numba imported": "numba" in sys.modules}


def child(argv: list[str]) -> None:
    """``--probe MODE [--warm] --out FILE``: one probe, its figures written to FILE as JSON."""
    result = probe(argv[argv.index("--probe") + 1], "--warm" in argv)
    with open(argv[argv.index("--out") + 1], "w") as f:
        json.dump(result, f)


# --- the parent -----------------------------------------------------------------------------

def row_of(measure: str, values: list[Any]) -> dict[str, Any]:
    """A figure over the rounds: min, median and max ms of wall and CPU time, or, for a
    yes/no, whether it was always, never or sometimes so."""
    if isinstance(values[0], bool):
        return {"measure": measure, "seen": "always" if all(values) else "never" if not any(values) else "sometimes"}
    row: dict[str, Any] = {"measure": measure}
    for clock_name, column in zip(("wall", "cpu"), zip(*values)):
        ms = [v * 1e3 for v in column]
        row.update({f"{clock_name}_ms_min": min(ms), f"{clock_name}_ms_median": statistics.median(ms),
                    f"{clock_name}_ms_max": max(ms)})
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # imported here, not at the top: the harness and fxopt import torch, which a probe times
    import importlib.util
    import os

    from harness import Record, cli, fresh_process, markdown_table

    import fxopt
    from fxopt.progress import progress

    parser = cli.parser(__doc__.split("\n\n")[0], rounds=7)
    parser.add_argument("--repeats", dest="rounds", type=int, help="the old name of --rounds")
    parser.add_argument("--probes", default=",".join(PROBES),
                        help=f"comma-separated probe groups (default all: {', '.join(PROBES)})")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.probes = 1, "lookup"
    groups = args.probes.split(",")
    unknown = [g for g in groups if g not in PROBES]
    if unknown:
        parser.error(f"unknown probe group(s) {', '.join(unknown)}; known: {', '.join(PROBES)}")
    cached = os.path.exists(importlib.util.cache_from_source(fxopt.__file__))
    record = Record("startup", args, "cpu", fxopt_bytecode_cached=cached)
    samples: dict[str, list[Any]] = {}
    for _ in progress(range(args.rounds), desc="rounds", unit="round"):
        for group in groups:  # interleaved: load drifts alike
            for mode, warm in PROBES[group]:
                result = fresh_process(__file__, ["--probe", mode, *(["--warm"] if warm else [])], PROBE_TIMEOUT_S)
                if "error" in result:
                    raise RuntimeError(f"probe {mode}{' (warm)' if warm else ''} failed: {result['error']}")
                del result["process_s"]
                for key, value in result.items():
                    samples.setdefault(key, []).append(value)
    for key, values in samples.items():
        record.add(row_of(key, values), save=False)
    record.save()
    print(f"{args.rounds} fresh processes each (python {record.meta['python']}, torch {record.meta['torch']}, "
          f"fxopt bytecode cached: {cached}); ms")
    print(markdown_table(record.rows, ["measure", "wall_ms_min", "wall_ms_median", "cpu_ms_min", "cpu_ms_median",
                                       "seen"], digits=1))
    return record.data


if __name__ == "__main__":
    if "--probe" in sys.argv:
        child(sys.argv)
    else:
        main()
