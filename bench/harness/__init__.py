"""One harness for every bench: timing, baselines, memory, the environment and the records.

A bench script is a workload definition plus what it prints; everything it would otherwise
re-implement lives here, so two benches time, compare and record the same way:

- :mod:`harness.cli` — ``parser(doc)``: the shared flags (``--smoke``, ``--out``, ``--rounds``),
  and ``device_for(args)`` (``--smoke`` always runs on the CPU, tiny shapes, a few seconds).
- :mod:`harness.timing` — ``call_ms`` (median ms of one call: ``triton.testing.do_bench``'s
  CUDA events on a GPU, the wall clock on a CPU; ``graph=True`` times a CUDA-graph replay),
  ``loop_ms`` (calls back to back, launch cost included; ``host=True``: the CPU's cost of
  issuing them), ``wall_ms`` (a synchronized call, host and device), ``host_ms`` (the CPU's
  cost of one call on an idle GPU), ``alternate`` (interleaved rounds, ``reverse_odd`` to
  alternate the order too, so that a drift of the machine hits every variant alike),
  ``fresh_process`` (one variant in a process of its own, its result read back as JSON) and
  ``clocked`` (wall and CPU seconds of one host-side run: optimize, rewrites, a report).
- :mod:`harness.baselines` — every Inductor mode a user could pick (``INDUCTOR_MODES``:
  default, +freezing, reduce-overhead, reduce-overhead+freezing) through ``inductor_variant``
  (``observed_inductor`` for another mode or option set), each recording per compiled graph
  whether it was really frozen; ``frozen_summary`` and ``not_frozen`` turn that record into a
  verdict (a freezing baseline that did not freeze is a broken harness, never a figure).
- :mod:`harness.memory` — ``DeviceMemory``: peak reserved (from before the first call:
  compile-time transients and CUDA-graph pools included) and peak allocated, in MB; a
  ``with`` block, or ``start()`` ... ``stop()`` across blocks.
- :mod:`harness.env` — ``environment(device)``: GPU name, torch/triton/cuDNN versions, the
  commit, the CPU; ``slug`` names the folder of ``bench/results/<gpu>/``; ``cpu_threads(n)``
  sets torch's CPU threads for a block and puts them back.
- :mod:`harness.records` — ``Record``: the JSON of one run (``meta`` = the environment and the
  arguments, ``rows``, and anything else in ``extra``), rewritten on every ``save()`` so that
  a run cut short keeps what it measured, by default at ``bench/results/<gpu>/<bench>.json``
  (``<gpu>x<n>`` over n GPUs); ``markdown_table`` for the printed summary.

A bench on the harness (how the quantization benches are meant to be ported)::

    from harness import (DeviceMemory, Record, alternate, call_ms, cli, frozen_summary,
                         inductor_variant, markdown_table, median)

    def main(argv=None):
        args = cli.parser(__doc__).parse_args(argv)      # add the bench's own flags first
        device = cli.device_for(args)                    # "cpu" under --smoke
        record = Record("my_bench", args, device)
        model, x = build(tiny=args.smoke)                # the workload: the bench's own job
        stats = {}
        base, context = inductor_variant("inductor_freezing", model, stats)
        with DeviceMemory(device) as memory, context():
            base(x)                                       # compiles; reserved counts from here
        samples = alternate({"bf16": lambda: base(x), "int8": lambda: mine(x)}, args.rounds,
                            lambda fn: call_ms(fn, device))
        record.add({"M": x.shape[0], **{k: median(v) for k, v in samples.items()},
                    **memory.record(), "baseline": frozen_summary("inductor_freezing", stats)})
        print(markdown_table(record.rows, ["M", "bf16", "int8"]))
        return record.data

Then add the bench to ``SMOKES`` in ``tests/bench/test_smoke.py`` (a test fails for a bench
that imports the harness without one). ``bench/gpu_zoo.py`` exports ``make_variant`` (the
Inductor modes above and fxopt's variants, by name), ``build``, ``rel_l2`` and the profile
helpers that ``serving.py``, ``serving_seq.py`` and ``decoder.py`` import.

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
from harness.env import cpu_threads, environment, slug
from harness.memory import DeviceMemory
from harness.records import Record, markdown_table, results_dir
from harness.timing import (
    Clocked,
    alternate,
    call_ms,
    clocked,
    fresh_process,
    host_ms,
    loop_ms,
    median,
    sync,
    wall_ms,
)

__all__ = ["INDUCTOR_MODES", "MUST_FREEZE", "SELF_GRAPHED", "Clocked", "DeviceMemory", "Record", "alternate",
           "call_ms", "cli", "clocked", "cpu_threads", "environment", "fresh_process", "frozen_summary", "host_ms",
           "inductor_variant", "loop_ms", "markdown_table", "median", "not_frozen", "observed_inductor",
           "results_dir", "slug", "sync", "wall_ms"]
