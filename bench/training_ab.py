"""Inductor default and fxopt with the replay off, compiled in one process and timed in turn.

Why a second training bench: the replay-off step is host-bound, and the host's speed moves
between processes by more than the 2 % this comparison is about (bench/training.py runs
each variant in a process of its own, for memory). Here both compile the same step (two
copies of one model, the same weights) in one process, then run interleaved rounds of
``--steps`` steps; cProfile then counts the Python calls each makes per step, which is what
fxopt adds on the host whatever the machine's speed.

    python bench/training_ab.py --workload resnet50 --rounds 3
    python bench/training_ab.py --smoke       # CPU, tiny model
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import training  # noqa: E402 - the workloads and the step live there


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("resnet50", "transformer"), default="resnet50")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.backends.cudnn.benchmark = True

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    steps = {}
    for variant in ("inductor", "fxopt-plain"):
        model, batches, optimizer, description = training.workload(args.workload, args.smoke, device)
        steps[variant], _ = training.compiled(variant, training.make_step(model, optimizer), [])
        for i in range(3):  # compile, then warm up
            steps[variant](*batches[i % len(batches)])
    print(description, flush=True)
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(args.rounds):
        for variant, fn in steps.items():
            sync()
            began = time.perf_counter()
            for i in range(args.steps):
                fn(*batches[i % len(batches)])
            sync()
            times[variant].append((time.perf_counter() - began) / args.steps * 1e3)
    for variant, fn in steps.items():
        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(5):
            fn(*batches[i % len(batches)])
        sync()
        profiler.disable()
        calls = pstats.Stats(profiler).total_calls / 5
        rounds = " ".join(f"{t:.2f}" for t in times[variant])
        print(f"{variant:12} ms/step by round: {rounds}  (best {min(times[variant]):.2f}); "
              f"Python calls per step: {calls:.0f}", flush=True)
    print(f"fxopt-plain / inductor, best of rounds: {min(times['fxopt-plain']) / min(times['inductor']):.3f}x the time")


if __name__ == "__main__":
    main()
