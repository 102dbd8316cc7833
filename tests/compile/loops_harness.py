"""The harness of test_training_loops.py: one training loop run twice from the same state,
once as written (or through a reference compile) and once through fxopt, everything the loop
leaves behind compared, and the CUDA-graph launches of the fxopt run counted.

Why a harness: each case of issue #29 is a different loop (gradient accumulation, two
forwards per step, ``autograd.grad``, AMP, ...), but what must hold is the same for all of
them: the compiled loop is the plain loop, step by step, and a CUDA graph was replayed (or,
where a case cannot be replayed soundly, none was and a report says why).

Replay is detected outside fxopt: the profiler records the CUDA runtime calls of the last
:data:`COUNTED` steps, and a ``cudaGraphLaunch`` there is a replay (Inductor's CUDA-graph
trees also launch a graph right after capturing it, so captures, ``cudaStreamBeginCapture``,
are counted too and a replay must launch more graphs than it captures).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_map

import fxopt

STEPS = 20
#: the last steps whose CUDA-graph launches and captures are counted (earlier steps compile,
#: warm up and record)
COUNTED = 3
SEED = 1234
#: float32 tolerances of a compiled loop against the plain one: Inductor's fused kernels sum
#: in another order than eager's (1e-7 relative per op), which 20 SGD steps on these small
#: models keep far below 1e-4; a stale, overwritten or skipped value is off by 1e-2 or more
FLOAT32 = {"rtol": 1e-4, "atol": 1e-5}


class Mlp(nn.Module):
    """Linear, batch norm (running statistics), ReLU, dropout, Linear: every kind of training
    state, in float32 and small enough that a step takes microseconds of GPU time. Linear
    layers only: cuBLAS float32 matmuls are not TF32 by default (cuDNN convolutions are), so
    eager and compiled steps agree to float32 rounding."""

    def __init__(self, bn: bool = True, p: float = 0.0):
        super().__init__()
        # no bias before batch norm, which subtracts it again: its gradient would be rounding
        # noise, which Adam scales up to full steps of arbitrary sign
        self.fc1 = nn.Linear(16, 32, bias=not bn)
        self.bn = nn.BatchNorm1d(32) if bn else nn.Identity()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


class GraphCalls:
    """The ``cudaGraphLaunch`` and ``cudaStreamBeginCapture`` runtime calls the profiler sees
    while counting (host-side CUDA runtime events; zero on a machine without CUDA)."""

    def __init__(self) -> None:
        self.launches = 0
        self.captures = 0
        self._profiler: profile | None = None

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities)
        self._profiler.start()

    def stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        names = [event.name for event in profiler.events()]
        self.launches += sum("cudaGraphLaunch" in name for name in names)
        self.captures += sum("cudaStreamBeginCapture" in name for name in names)

    @contextlib.contextmanager
    def counting(self) -> Iterator[GraphCalls]:
        self.start()
        try:
            yield self
        finally:
            self.stop()


def replayed(fn: Callable[[], Any]) -> int:
    """How many CUDA graphs ``fn()`` launches."""
    calls = GraphCalls()
    with calls.counting():
        fn()
    return calls.launches


@dataclass
class Run:
    """What a loop is given besides the model, optimizer and function it trains with: the
    batches, and where to keep what it produces for the comparison at the end."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    held_out: tuple[torch.Tensor, torch.Tensor]
    device: str
    #: whether the last steps count graph calls (the fxopt run does, the reference does not)
    counting: bool = True
    kept: dict[str, list[Any]] = field(default_factory=dict)
    calls: GraphCalls = field(default_factory=GraphCalls)

    def steps(self) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        """The step numbers and batches; the last :data:`COUNTED` steps count graph calls."""
        for i, batch in enumerate(self.batches):
            counted = self.counting and i >= len(self.batches) - COUNTED
            if counted:
                self.calls.start()
            yield i, batch
            if counted and self.calls.active:
                self.calls.stop()

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Graph calls in this block are not the training step's (an inference replay of an
        evaluation between steps is no training replay)."""
        counting = self.calls.active
        if counting:
            self.calls.stop()
        try:
            yield
        finally:
            if counting:
                self.calls.start()

    def keep(self, tag: str, value: Any) -> None:
        """Keep ``value`` itself (not a copy) until the end: a later step that overwrites it
        shows in the comparison."""
        self.kept.setdefault(tag, []).append(value)

    def snapshot(self, tag: str, tensor: torch.Tensor) -> None:
        """Keep a copy of a tensor that the loop updates in place (running statistics)."""
        self.keep(tag, tensor.detach().clone())

    def close(self) -> None:
        if self.calls.active:
            self.calls.stop()


Loop = Callable[[nn.Module, torch.optim.Optimizer, Callable, Run], None]


def model_only(model: nn.Module, opt: torch.optim.Optimizer) -> nn.Module:
    """What to compile: the model alone (``fxopt.compile(model)``), the rest of the step eager."""
    return model


@dataclass
class Case:
    """One training loop of issue #29, item 1."""

    loop: Loop
    #: the thing compiled, from the model and its optimizer: the model itself, or a step function
    target: Callable[[nn.Module, torch.optim.Optimizer], Callable] = model_only
    model: Callable[[], nn.Module] = Mlp
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = \
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    #: applied to the model on its device before the optimizer is built (DDP)
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m
    #: backend options of the fxopt run besides ``reports`` (none: the defaults)
    options: dict[str, Any] = field(default_factory=dict)
    #: backend options of the reference run; None: the loop as written, no compile at all
    reference: dict[str, Any] | None = None
    tolerance: dict[str, float] = field(default_factory=lambda: dict(FLOAT32))
    batch_sizes: tuple[int, ...] = (16,)


@dataclass
class Outcome:
    """Everything a loop leaves behind, and what the backend said and did."""

    state: dict[str, Any]
    rng: list[torch.Tensor]
    reports: list[Any]
    calls: GraphCalls


def make_batches(case: Case, device: str) -> tuple[list, tuple]:
    gen = torch.Generator().manual_seed(SEED)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16, generator=gen).to(device), torch.randint(0, 4, (n,), generator=gen).to(device)

    sizes = case.batch_sizes
    # the held-out batch has the first size: another size would make Dynamo recompile the
    # graph for dynamic shapes, a case of its own (last_smaller_batch)
    return [batch(sizes[i % len(sizes)]) for i in range(STEPS)], batch(sizes[0])


def compile_target(target: Callable, options: dict[str, Any]) -> Callable:
    """``fxopt.compile(model)`` for a module, ``torch.compile(step, backend="fxopt")`` for a
    step function."""
    if isinstance(target, nn.Module):
        return fxopt.compile(target, options=options)
    return torch.compile(target, backend="fxopt", options=options)


def execute(case: Case, base: nn.Module, device: str, options: dict[str, Any] | None, *,
            counting: bool) -> Outcome:
    """``case.loop`` on a copy of ``base``: as written (``options`` None) or with its target
    compiled by the fxopt backend with ``options``; ``counting``: count the graph calls of
    the last steps."""
    torch._dynamo.reset()
    model = case.wrap(copy.deepcopy(base).to(device))
    opt = case.optimizer(model)
    target = case.target(model, opt)
    reports: list[Any] = []
    fn = target if options is None else compile_target(target, {**options, "reports": reports})
    batches, held_out = make_batches(case, device)
    run = Run(batches, held_out, device, counting=counting)
    torch.manual_seed(SEED)
    torch.cuda.manual_seed(SEED)
    try:
        case.loop(model, opt, fn, run)
    finally:
        run.close()
    state = {
        "kept": tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, run.kept),
        "parameters": {n: p.detach() for n, p in model.named_parameters()},
        "gradients": {n: p.grad for n, p in model.named_parameters()},
        "optimizer": tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, opt.state_dict()["state"]),
        "buffers": dict(model.named_buffers()),
    }
    rng = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if device == "cuda" else [])
    return Outcome(state, rng, reports, run.calls)


def check_case(case: Case, device: str, expect_replay: bool) -> None:
    """The loop through fxopt computes what the reference loop computes, and a CUDA graph
    was replayed in its last steps if and only if ``expect_replay``."""
    torch.manual_seed(0)
    base = case.model()
    want = execute(case, base, device, case.reference, counting=False)
    got = execute(case, base, device, case.options, counting=True)
    for part, value in want.state.items():
        torch.testing.assert_close(got.state[part], value, equal_nan=True, **case.tolerance,
                                   msg=lambda m, part=part: f"{part}: {m}")
    for got_rng, want_rng in zip(got.rng, want.rng):
        assert torch.equal(got_rng, want_rng), "the loop drew other random numbers than the reference"
    check_replay(got, expect_replay)


def check_replay(outcome: Outcome, expect_replay: bool) -> None:
    """Launches seen, reports agreeing: a replay where one is expected, none and a reason
    where the case runs plainly."""
    calls, reports = outcome.calls, outcome.reports
    said = [(r.name, r.training, r.fallback or r.no_replay) for r in reports]
    if expect_replay:
        assert calls.launches > calls.captures, (
            f"no CUDA graph replayed in the last {COUNTED} steps ({calls.launches} launches, "
            f"{calls.captures} captures); the reports: {said}")
        assert any(r.training and r.fallback is None and r.no_replay is None for r in reports), said
    else:
        assert calls.launches == 0, f"{calls.launches} CUDA graphs launched where none may be; the reports: {said}"
        assert any(r.no_replay for r in reports), f"no report says why nothing is replayed: {said}"
