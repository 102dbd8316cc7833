"""Host cost per call of the frozen-weight check (``FrozenWeights`` in the backend).

A graph compiled with its weights frozen compares every frozen weight's version counter with
the one seen at compile time on each call, so that a weight written in place (an optimizer
step, ``load_state_dict``) is noticed. This measures what the check adds to a call, on the
CPU (version counters are host-side, the same for CUDA tensors), for the frozen-tensor
counts of resnet50 (161 parameters and the running mean and variance of its 53 batch norms:
everything an inference graph reads and never writes is frozen; ``num_batches_tracked`` is not
read in eval mode) and vit_b_16 (152 parameters), and for a 160-tensor list:
``FrozenWeights`` around a compiled function that does nothing, against a function that
takes the same arguments and passes the kept input on, as ``FrozenWeights`` does less the check. The check is put against a call's time on
the GPU (``--call-ms``, defaults from bench/RESULTS.md: fxopt's CUDA-graph replay of resnet50
and vit_b_16, bf16, batch 32, on an H100).

    python bench/frozen_check_cost.py
"""

from __future__ import annotations

import argparse
import timeit

import torch

from fxopt.compile.freezing import FrozenWeights

#: frozen tensors per model: (parameters, buffers)
MODELS = {"resnet50": (161, 106), "vit_b_16": (152, 0), "160 tensors": (160, 0)}
CALL_MS = {"resnet50": 1.33, "vit_b_16": 3.39}


def per_call_us(fn, args: tuple, number: int, repeat: int) -> float:
    """Best of ``repeat`` means over ``number`` calls, in microseconds."""
    return min(timeit.repeat(lambda: fn(*args), number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--call-ms", default=",".join(f"{k}={v}" for k, v in CALL_MS.items()),
                        help="a call's time on the GPU per model, ms: name=ms,...")
    args = parser.parse_args()
    call_ms = {k: float(v) for k, v in (item.split("=") for item in args.call_ms.split(","))}
    print(f"torch {torch.__version__}; per call, best of {args.repeat} x {args.number} calls")
    lists = [[0]] * 320
    yardstick = per_call_us(lambda: list(map(len, lists)), (), args.number, args.repeat)
    print(f"host speed: list(map(len, ...)) over 320 lists takes {yardstick:.2f} us here")
    for name, (params, buffers) in MODELS.items():
        weights = [torch.nn.Parameter(torch.zeros(4)) for _ in range(params)] + \
                  [torch.zeros(4) for _ in range(buffers)]
        x = torch.zeros(4)

        def compiled(*inputs):
            return inputs

        def unchecked(*inputs):  # what FrozenWeights does less the check: pick the kept inputs
            return compiled(inputs[0])

        frozen = FrozenWeights(compiled, [0], weights, lambda args: compiled)
        call = (x, *weights)  # as Dynamo calls it: the input, then every lifted weight
        plain = per_call_us(unchecked, call, args.number, args.repeat)
        checked = per_call_us(frozen, call, args.number, args.repeat)
        assert frozen.plain is None, "a weight changed during the measurement"
        cost = checked - plain
        line = f"{name:12s} {params + buffers:4d} frozen tensors: check {cost:6.2f} us per call"
        if name in call_ms:
            line += f" = {cost / (call_ms[name] * 1e3):.3%} of a {call_ms[name]} ms call"
        print(line)


if __name__ == "__main__":
    main()
