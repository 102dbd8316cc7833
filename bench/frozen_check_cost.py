"""Host cost per call of the frozen-weight check (``FrozenWeights`` in the backend).

A graph compiled with its weights frozen compares every frozen weight's version counter with
the one seen at compile time on each call, so that a weight written in place (an optimizer
step, ``load_state_dict``) is noticed. This measures what the check adds to a call, on the
CPU (version counters are host-side, the same for CUDA tensors), for the frozen-tensor
counts of resnet50 (161 parameters and the running mean and variance of its 53 batch norms:
everything an inference graph reads and never writes is frozen; ``num_batches_tracked`` is not
read in eval mode) and vit_b_16 (152 parameters), and for a 160-tensor list:
``FrozenWeights`` around a compiled function that does nothing, against a function that
takes the same arguments and passes the kept input on, as ``FrozenWeights`` does less the
check. The two are timed in alternating rounds (the harness's ``loop_ms``: ``--number`` calls
back to back on the wall clock), the best round of each kept. The check is put against a
call's time on the GPU (``--call-ms``, defaults from bench/RESULTS.md: fxopt's CUDA-graph
replay of resnet50 and vit_b_16, bf16, batch 32, on an H100).

    python bench/frozen_check_cost.py [--number 20000] [--rounds 7]   # bench/results/cpu/frozen_check_cost.json
    python bench/frozen_check_cost.py --smoke                          # 200 calls, 2 rounds (CI)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from harness import Record, alternate, cli, loop_ms, markdown_table

from fxopt.compile.freezing import FrozenWeights

#: frozen tensors per model: (parameters, buffers)
MODELS = {"resnet50": (161, 106), "vit_b_16": (152, 0), "160 tensors": (160, 0)}
CALL_MS = {"resnet50": 1.33, "vit_b_16": 3.39}


def best_us(variants: dict[str, Callable[[], Any]], number: int, rounds: int) -> dict[str, float]:
    """Microseconds per call of each variant: the best of ``rounds`` alternating rounds of
    ``number`` calls (the least disturbed, as ``timeit`` advises for a host-side cost)."""
    samples = alternate(variants, rounds, lambda fn: loop_ms(fn, "cpu", iters=number, reps=1, warmup=0))
    return {name: min(times) * 1e3 for name, times in samples.items()}


def check_cost(params: int, buffers: int, number: int, rounds: int) -> dict[str, float]:
    """The per-call microseconds of a call without the check, with it, and their difference."""
    weights = [torch.nn.Parameter(torch.zeros(4)) for _ in range(params)] + [torch.zeros(4) for _ in range(buffers)]

    def compiled(*inputs: Any) -> tuple:
        return inputs

    def unchecked(*inputs: Any) -> tuple:  # what FrozenWeights does less the check: pick the kept inputs
        return compiled(inputs[0])

    frozen = FrozenWeights(compiled, [0], weights, lambda args: compiled)
    call = (torch.zeros(4), *weights)  # as Dynamo calls it: the input, then every lifted weight
    us = best_us({"plain_us": lambda: unchecked(*call), "checked_us": lambda: frozen(*call)}, number, rounds)
    assert frozen.plain is None, "a weight changed during the measurement"
    return {**us, "check_us": us["checked_us"] - us["plain_us"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0], rounds=7)
    parser.add_argument("--number", type=int, default=20000, help="calls per round")
    parser.add_argument("--call-ms", default=",".join(f"{k}={v}" for k, v in CALL_MS.items()),
                        help="a call's time on the GPU per model, ms: name=ms,...")
    args = parser.parse_args(argv)
    if args.smoke:
        args.number, args.rounds = 200, 2
    call_ms = {k: float(v) for k, v in (item.split("=") for item in args.call_ms.split(","))}
    record = Record("frozen_check_cost", args, "cpu")
    lists = [[0]] * 320
    record.extra["yardstick_us"] = best_us({"map": lambda: list(map(len, lists))}, args.number, args.rounds)["map"]
    print(f"torch {record.meta['torch']}; per call, best of {args.rounds} rounds of {args.number} calls; "
          f"host speed: list(map(len, ...)) over 320 lists takes {record.extra['yardstick_us']:.2f} us here")
    for name, (params, buffers) in MODELS.items():
        row = record.add({"model": name, "frozen_tensors": params + buffers,
                          **check_cost(params, buffers, args.number, args.rounds)})
        if name in call_ms:
            row.update(call_ms=call_ms[name], share_of_call=row["check_us"] / (call_ms[name] * 1e3))
    record.save()
    print(markdown_table(record.rows, ["model", "frozen_tensors", "plain_us", "checked_us", "check_us",
                                       "call_ms", "share_of_call"], digits=4))
    return record.data


if __name__ == "__main__":
    main()
