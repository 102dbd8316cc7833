"""One harness for every bench: timing, baselines, memory, the environment and the records.

A bench script is a workload definition plus what it prints; everything it would otherwise
re-implement lives here, so two benches time, compare and record the same way:

- :mod:`harness.cli` — ``parser(doc)``: the shared flags (``--smoke``, ``--out``, ``--rounds``),
  and ``device_for(args)`` (``--smoke`` always runs on the CPU, tiny shapes, a few seconds).
- :mod:`harness.timing` — ``call_ms`` (median ms of one call: CUDA events on a GPU, the wall
  clock on a CPU; ``graph=True`` times CUDA-graph replays), ``loop_ms`` (calls back to back,
  launch cost included), ``wall_ms`` (a synchronized call, host and device), ``host_ms`` (the CPU's cost of one call on an idle GPU), ``alternate``
  (interleaved rounds, so that a drift of the machine hits every variant alike) and
  ``fresh_process`` (one variant in a process of its own, its result read back as JSON).
- :mod:`harness.baselines` — every Inductor mode a user could pick (``INDUCTOR_MODES``:
  default, +freezing, reduce-overhead, reduce-overhead+freezing) through ``inductor_variant``,
  each recording per compiled graph whether it was really frozen; ``frozen_summary`` and
  ``not_frozen`` turn that record into a verdict (a freezing baseline that did not freeze is
  a broken harness, never a figure).
- :mod:`harness.memory` — ``DeviceMemory``: peak reserved (from before the first call:
  compile-time transients and CUDA-graph pools included) and peak allocated, in MB.
- :mod:`harness.env` — ``environment(device)``: GPU name, torch/triton/cuDNN versions, the
  commit, the CPU; ``slug`` names the folder of ``bench/results/<gpu>/``.
- :mod:`harness.records` — ``Record``: the JSON of one run (``meta`` = the environment and the
  arguments, ``rows``), rewritten on every ``save()`` so that a run cut short keeps what it
  measured, by default at ``bench/results/<gpu>/<bench>.json``; ``markdown_table`` for the
  printed summary.

A new bench (the quantization benches are ported this way)::

    from harness import DeviceMemory, Record, alternate, call_ms, cli, inductor_variant

    def main(argv=None):
        parser = cli.parser(__doc__)
        args = parser.parse_args(argv)
        device = cli.device_for(args)
        record = Record("my_bench", args, device)
        ...                                   # build the workload, smaller under args.smoke
        samples = alternate({"eager": f, "fxopt": g}, args.rounds, lambda fn: call_ms(fn, device))
        record.add({"model": "m", **{k: median(v) for k, v in samples.items()}})
        record.save()
        print(markdown_table(record.rows, ["model", "eager", "fxopt"]))
        return record.data

Every bench's ``main(argv)`` returns what it wrote, so ``tests/bench/test_smoke.py`` runs
each one in-process with ``--smoke`` and checks the record's fields and variants.
Scripts import this package as ``harness``: ``python bench/x.py`` puts ``bench/`` on the
path, and the tests do the same.
"""

from harness import cli
from harness.baselines import (
    INDUCTOR_MODES,
    MUST_FREEZE,
    SELF_GRAPHED,
    frozen_summary,
    inductor_variant,
    not_frozen,
    observed_inductor,
)
from harness.env import environment, slug
from harness.memory import DeviceMemory
from harness.records import Record, markdown_table, results_dir
from harness.timing import (
    alternate,
    call_ms,
    fresh_process,
    host_ms,
    loop_ms,
    median,
    sync,
    wall_ms,
)

__all__ = ["INDUCTOR_MODES", "MUST_FREEZE", "SELF_GRAPHED", "DeviceMemory", "Record", "alternate", "call_ms", "cli",
           "environment", "fresh_process", "frozen_summary", "host_ms", "inductor_variant", "loop_ms",
           "markdown_table", "median", "not_frozen", "observed_inductor", "results_dir", "slug", "sync", "wall_ms"]
