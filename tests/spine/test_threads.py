"""fxopt's entry points called from several threads at once, on different graphs: each
gives the result a single thread would, and a model served in another thread meanwhile
is never affected (docs/passes.md, "Threads").

Graphs are traced up front, in the main thread: ``torch.fx.symbolic_trace`` of a user's
model is torch's own and patches ``nn.Module`` for the whole process while it runs. Every
job waits at a barrier so the threads overlap as much as they can; every exception of
every thread is collected and reported. ``FXOPT_THREAD_ROUNDS`` sets the rounds per case
(default 2, which keeps the module well under a minute); a soak run repeats the module
(docs/testing.md).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fxopt.patterns as fp
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from fxopt.visualize import diff_graphs, diff_to_dot, to_dot

import fxopt
import fxopt.quant as fq
from fxopt.errors import InputError, PatternError, UnknownPassError
from fxopt.testing.zoo import ZOO

ROUNDS = int(os.environ.get("FXOPT_THREAD_ROUNDS", "2"))
THREADS = 8
OPTIMIZED = ("residual_conv_bn_relu", "mlp", "attention", "unet_block", "densenet_block",
             "transformer_block", "multi_head", "demo")


def in_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run ``jobs`` at once, one thread each, released together by a barrier; their results
    in order, or an AssertionError saying how many raised, with the first one's traceback."""
    barrier = threading.Barrier(len(jobs))

    def run(job: Callable[[], Any]) -> Any:
        barrier.wait()
        return job()

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(run, job) for job in jobs]
    failures = [(i, f.exception()) for i, f in enumerate(futures) if f.exception() is not None]
    if failures:
        i, first = failures[0]
        raise AssertionError(f"{len(failures)} of {len(jobs)} thread(s) failed; job {i}:\n"
                             + "".join(traceback.format_exception(first)))
    return [f.result() for f in futures]


def fresh_inputs(case: Any, seed: int) -> tuple[torch.Tensor, ...]:
    return case.inputs(torch.float32, seed=1000 + seed)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_untouched(gm: fx.GraphModule, code: str, state: dict[str, torch.Tensor]) -> None:
    assert gm.code == code
    now = gm.state_dict()
    assert now.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(now[key], value), key


# --- concurrent optimize ----------------------------------------------------------------

def test_concurrent_optimize_gives_each_thread_a_correct_graph():
    """8 threads optimize different zoo models (default pipeline, verify on half of them);
    each result computes what the eager model computes, on fresh inputs, and the traced
    graph it started from is unchanged."""
    cases = [ZOO[name] for name in OPTIMIZED]
    for round_ in range(ROUNDS):
        work = []
        for i in range(THREADS):
            case = cases[(i + round_) % len(cases)]
            model = case.model()
            gm = fx.symbolic_trace(model)
            work.append((case, model, gm, gm.code, state_of(gm), i % 2 == 0))

        def job(case: Any, model: nn.Module, gm: fx.GraphModule, code: str, state: dict,
                verify: bool, seed: int) -> None:
            out = fxopt.optimize(gm, example_inputs=case.inputs(), verify=verify)
            assert out is not gm
            inputs = fresh_inputs(case, seed)
            rtol, atol = case.tolerance(torch.float32)
            with torch.no_grad():
                torch.testing.assert_close(out(*inputs), model(*inputs), rtol=rtol, atol=atol)
            assert_untouched(gm, code, state)

        in_threads([lambda w=w, s=round_ * THREADS + i: job(*w, s) for i, w in enumerate(work)])


# --- concurrent rewrites with freshly written patterns ----------------------------------

class AddReluNet(nn.Module):
    """relu(x + y) twice, and a sigmoid the patterns leave alone."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x + y)
        b = F.relu(a * 2.0 + y)
        return torch.sigmoid(a) + b


@torch.fx.wrap
def shifted_relu(t: torch.Tensor, shift: float) -> torch.Tensor:
    """A leaf function (torch.fx.wrap) that replacements call: kept as one node."""
    return torch.clamp_min(t + shift, shift) - shift


#: the function itself: torch's symbolic_trace, while it runs, puts a recording wrapper in
#: its place under its own name (in this module's globals)
SHIFTED_RELU = shifted_relu


def rewrite(gm: fx.GraphModule, how: str, shift: float) -> int:
    """Rewrite relu(a + b) in ``gm`` with patterns written now (fresh functions, so each
    call traces them anew), through one of the three entry points."""
    def pattern(a, b):
        return torch.relu(a + b)

    def module_pattern(a, b):  # the module spelling: nn.ReLU's forward runs on proxies
        return nn.ReLU()(a + b)

    def replacement(a, b):
        return shifted_relu(a + b, shift)

    if how == "replace":
        return fp.replace(gm, module_pattern, replacement)
    if how == "replace_pattern":
        return len(fp.replace_pattern(gm, pattern, replacement))
    return fp.replace(gm, fp.rule(pattern, replacement, a=fp.is_tensor, b=fp.is_tensor))


def test_concurrent_rewrites_with_freshly_traced_patterns():
    """8 threads each define a pattern and a replacement (closures over their own
    constant, calling a torch.fx.wrap'd function) and rewrite their own graph through
    ``replace``, ``replace_pattern`` or a ``Rule``: both matches are rewritten, the wrapped
    function stays one node, and the graph computes the eager model's function."""
    model = AddReluNet()
    for round_ in range(ROUNDS):
        graphs = [fx.symbolic_trace(model) for _ in range(THREADS)]
        in_threads([functools.partial(rewrite_and_check, gm, model, WAYS[(i + round_) % 3], 0.25 * (i + 1),
                                      round_ * THREADS + i) for i, gm in enumerate(graphs)])


WAYS = ("replace", "replace_pattern", "rule")


def rewrite_and_check(gm: fx.GraphModule, model: nn.Module, how: str, shift: float, seed: int) -> None:
    """Both matches rewritten, the wrapped function one node each, eager's function."""
    assert rewrite(gm, how, shift) == 2
    check_rewritten(gm, model, seed)


def check_rewritten(gm: fx.GraphModule, model: nn.Module, seed: int) -> None:
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(SHIFTED_RELU) == 2
    assert torch.relu not in targets and F.relu not in targets
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    torch.testing.assert_close(gm(x, y), model(x, y), rtol=1e-6, atol=1e-6)


class OffsetRelu(nn.Module):
    def __init__(self, offset: float):
        super().__init__()
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.offset)


def test_one_rule_with_a_replacement_callback_shared_by_threads():
    """One Rule whose replacement is chosen per match (by the sign of the captured
    literal) rewrites 8 graphs at once: each gets the replacement its own match chose."""
    def pattern(x, k):
        return torch.relu(x + k)

    def positive(x, k):
        return torch.clamp_min(x + k, 0.0)

    def negative(x, k):
        return torch.where(x + k > 0, x + k, torch.zeros_like(x))

    shared = fp.rule(pattern, replacement_callback=lambda m: positive if m["k"] > 0 else negative)
    for _ in range(ROUNDS):
        offsets = [(-1) ** i * (0.5 + i) for i in range(THREADS)]
        graphs = [fx.symbolic_trace(OffsetRelu(k)) for k in offsets]

        def job(gm: fx.GraphModule, k: float) -> None:
            assert fp.replace(gm, shared) == 1
            targets = {n.target for n in gm.graph.nodes}
            assert (torch.clamp_min in targets) == (k > 0) and (torch.where in targets) == (k < 0)
            x = torch.randn(16, generator=torch.Generator().manual_seed(3))
            torch.testing.assert_close(gm(x), OffsetRelu(k)(x))

        in_threads([functools.partial(job, gm, k) for gm, k in zip(graphs, offsets)])


# --- concurrent quantization ------------------------------------------------------------

class TwoLinears(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, width), nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_concurrent_quantize_model_gives_the_single_threaded_result():
    """8 threads quantize different models (two modes); each result equals the one the
    same call gives in one thread, on fresh inputs, and stays close to the float model."""
    modes = ("int8_weight_only", "int8_dynamic")
    torch.manual_seed(0)
    models = [TwoLinears(48 + 16 * (i % 4)).eval() for i in range(THREADS)]
    example = (torch.randn(4, 32),)
    graphs = [fx.symbolic_trace(m) for m in models]
    expected = [fq.quantize_model(gm, example, modes[i % 2]) for i, gm in enumerate(graphs)]
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(7))
    for _ in range(ROUNDS):
        def job(i: int) -> None:
            gm, code, state = graphs[i], graphs[i].code, state_of(graphs[i])
            q = fq.quantize_model(gm, example, modes[i % 2])
            assert any("fxopt_quant" in str(n.target) for n in q.graph.nodes)
            torch.testing.assert_close(q(x), expected[i](x), rtol=0, atol=0)
            reference = models[i](x)
            assert fq.accuracy.sqnr(reference, q(x)) > 25  # int8 weights: 39 to 47 dB on these models
            assert_untouched(gm, code, state)

        in_threads([lambda i=i: job(i) for i in range(THREADS)])


# --- concurrent rendering ---------------------------------------------------------------

def test_concurrent_rendering_gives_the_single_threaded_dot_source():
    """8 threads draw graphs and before/after diffs of different models: the dot source is
    the one a single thread writes."""
    graphs = []
    for name in OPTIMIZED:
        case = ZOO[name]
        before = fx.symbolic_trace(case.model())
        graphs.append((before, fxopt.optimize(before, example_inputs=case.inputs())))
    expected = [(to_dot(b), diff_to_dot(diff_graphs(b, a))) for b, a in graphs]
    for _ in range(ROUNDS):
        def job(i: int) -> None:
            before, after = graphs[i % len(graphs)]
            assert (to_dot(before), diff_to_dot(diff_graphs(before, after))) == expected[i % len(graphs)]

        in_threads([lambda i=i: job(i) for i in range(THREADS)])


# --- a model served in another thread -----------------------------------------------------

def test_serving_thread_is_never_affected_while_the_main_thread_works():
    """A thread serves eager forwards of a conv/BN model (checking every output) while the
    main thread optimizes, rewrites with fresh patterns, quantizes and renders: no served
    call fails or changes its result."""
    case = ZOO["residual_conv_bn_relu"]
    served = case.model()
    inputs = fresh_inputs(case, 0)
    with torch.no_grad():
        expected = served(*inputs)
    stop, started = threading.Event(), threading.Event()
    calls, failures = [0], []

    def serve() -> None:
        while not stop.is_set():
            try:
                with torch.no_grad():
                    out = served(*inputs)
                if not torch.equal(out, expected):
                    failures.append("a different output")
            except Exception as exc:  # noqa: BLE001 - every failure of the served model counts
                failures.append(f"{type(exc).__name__}: {exc}")
            calls[0] += 1
            started.set()

    work = [(ZOO[name], fx.symbolic_trace(ZOO[name].model())) for name in OPTIMIZED]
    rewrites = [fx.symbolic_trace(AddReluNet()) for _ in range(3 * ROUNDS)]
    linears = fx.symbolic_trace(TwoLinears(64).eval())
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        assert started.wait(60)
        for round_ in range(ROUNDS):
            for case_, gm in work:
                out = fxopt.optimize(gm, example_inputs=case_.inputs())
                to_dot(out)
            for i in range(3):
                assert rewrite(rewrites[3 * round_ + i], ("replace", "replace_pattern", "rule")[i], 0.5) == 2
            fq.quantize_model(linears, (torch.randn(2, 32),))
            diff_to_dot(diff_graphs(work[0][1], out))
    finally:
        stop.set()
        server.join(60)
    assert not failures, f"{len(failures)} of {calls[0]} served calls failed, e.g. {failures[0]}"
    assert calls[0] > 0


# --- bad input in a thread --------------------------------------------------------------

def test_bad_input_in_a_thread_raises_its_typed_error_there_and_leaves_the_model_untouched():
    """Among threads doing good work, threads given bad input (a pattern with parameters,
    an unknown pass, a training-mode model to quantize) get their own typed error; their
    models are unchanged and the good threads' results are right."""
    def bad_pattern(x):
        return nn.Linear(5, 5)(x)

    def bad_rewrite(gm: fx.GraphModule) -> None:
        with pytest.raises(PatternError, match="Linear has parameters or buffers"):
            fp.replace(gm, bad_pattern, lambda x: x.relu())

    def bad_pass(gm: fx.GraphModule) -> None:
        with pytest.raises(UnknownPassError, match="no_such_pass"):
            fxopt.optimize(gm, passes=["cse", "no_such_pass"])

    def bad_quantize(gm: fx.GraphModule) -> None:
        with pytest.raises(InputError, match="eval"):
            fq.quantize_model(gm, (torch.randn(2, 32),))

    for _ in range(ROUNDS):
        jobs, checks = [], []
        for i in range(THREADS):
            if i % 4 == 0:
                gm = fx.symbolic_trace(AddReluNet())
                jobs.append(lambda gm=gm: bad_rewrite(gm))
            elif i % 4 == 1:
                gm = fx.symbolic_trace(ZOO["mlp"].model())
                jobs.append(lambda gm=gm: bad_pass(gm))
            elif i % 4 == 2:
                gm = fx.symbolic_trace(TwoLinears(32).train())
                jobs.append(lambda gm=gm: bad_quantize(gm))
            else:
                gm = fx.symbolic_trace(AddReluNet())
                jobs.append(lambda gm=gm, i=i: rewrite(gm, "replace", 0.5) == 2 or pytest.fail("no rewrite"))
            checks.append((gm, gm.code, state_of(gm), i % 4 != 3))
        in_threads(jobs)
        for gm, code, state, bad in checks:
            if bad:
                assert_untouched(gm, code, state)


def test_pattern_tracing_patches_nothing_process_wide():
    """While a pattern is traced, nn.Module's own __call__/__getattr__ and the globals of a
    module with torch.fx.wrap registrations are what they always are."""
    seen, namespace = [], globals()  # this module's own globals (the traced code sees a copy)
    original = (nn.Module.__call__, nn.Module.__getattr__, namespace["shifted_relu"])

    def pattern(a, b):
        seen.append((nn.Module.__call__, nn.Module.__getattr__, namespace["shifted_relu"]))
        return torch.relu(a + b)

    def replacement(a, b):
        seen.append((nn.Module.__call__, nn.Module.__getattr__, namespace["shifted_relu"]))
        return shifted_relu(a + b, 0.5)

    gm = fx.symbolic_trace(AddReluNet())
    assert fp.replace(gm, pattern, replacement) == 2
    assert seen == [original, original]
    assert sum(n.target is shifted_relu for n in gm.graph.nodes) == 2


def test_a_copy_of_a_graph_module_is_independent_in_threads():
    """Deep copies made in threads (what a serving process does per worker) rewrite
    independently of each other and of the original."""
    base = fx.symbolic_trace(AddReluNet())
    code = base.code

    def job(i: int) -> int:
        return rewrite(copy.deepcopy(base), ("replace", "replace_pattern", "rule")[i % 3], 0.5)

    assert in_threads([lambda i=i: job(i) for i in range(THREADS)]) == [2] * THREADS
    assert base.code == code


def test_concurrent_optimize_of_one_graph_whose_values_share_a_fake_mode():
    """8 threads optimize the same GraphModule, whose recorded shapes (``meta['val']``)
    all belong to one fake mode: each result is right and the graph is unchanged."""
    for name in ("residual_conv_bn_relu", "transformer_block"):
        instance, model = ZOO[name].instantiate(), ZOO[name].model()
        code, state = instance.gm.code, state_of(instance.gm)
        for round_ in range(ROUNDS):
            in_threads([functools.partial(optimize_and_check, instance, model, round_ * THREADS + i)
                        for i in range(THREADS)])
        assert_untouched(instance.gm, code, state)


def test_concurrent_optimize_without_example_inputs_runs_the_shared_fake_mode_in_turn(caplog):
    """Without example inputs, shapes are propagated in the fake mode of the graph's own
    values: 8 threads optimizing one graph take turns with it (a fake mode run by two
    threads at once fails inside torch, which logs it and loses shapes), and each gets the
    single-threaded result."""
    for name in ("residual_conv_bn_relu", "densenet_block"):
        instance = ZOO[name].instantiate()
        expected = fxopt.optimize(instance.gm).code
        with caplog.at_level(logging.ERROR, logger="torch._subclasses.fake_tensor"):
            for _ in range(ROUNDS):
                codes = in_threads([functools.partial(optimized_code, instance.gm)] * THREADS)
                assert codes == [expected] * THREADS
        assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]


def optimized_code(gm: fx.GraphModule) -> str:
    return fxopt.optimize(gm).code


def optimize_and_check(instance: Any, model: nn.Module, seed: int) -> None:
    out = fxopt.optimize(instance.gm, example_inputs=instance.inputs)
    inputs = fresh_inputs(instance.case, seed)
    with torch.no_grad():
        torch.testing.assert_close(out(*inputs), model(*inputs), rtol=instance.rtol, atol=instance.atol)


def test_verification_leaves_the_global_generator_to_other_threads():
    """Verifying a graph without random ops does not seed torch's generator: a thread
    drawing random numbers meanwhile gets exactly the numbers its own seed gives."""
    case = ZOO["residual_conv_bn_relu"]
    graphs = [fx.symbolic_trace(case.model()) for _ in range(ROUNDS)]
    stop, drawn = threading.Event(), []

    def draw() -> None:
        while not stop.is_set() or len(drawn) < 10:
            drawn.append(torch.randn(8))
            time.sleep(0.001)  # draws all through the verification, without hogging the GIL

    torch.manual_seed(123)
    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        for gm in graphs:
            fxopt.optimize(gm, example_inputs=case.inputs(), verify=True)
    finally:
        stop.set()
        thread.join(60)
    g = torch.Generator().manual_seed(123)
    expected = [torch.randn(8, generator=g) for _ in drawn]
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected))


def test_rewrites_while_another_thread_runs_torch_symbolic_trace():
    """torch's own symbolic_trace (of a user's model, in another thread) patches the
    globals of every module with torch.fx.wrap'd functions while it runs: a replacement
    traced meanwhile still records the wrapped function itself, and every rewrite is right.
    symbolic_trace patches nn.Module too, so nothing here calls a module while it runs
    (no module-spelled patterns; the results are run afterwards)."""
    model = AddReluNet()
    graphs = [fx.symbolic_trace(model) for _ in range(4 * ROUNDS)]
    stop, traced = threading.Event(), [0]

    def trace() -> None:
        while not stop.is_set():
            fx.symbolic_trace(model)
            traced[0] += 1

    thread = threading.Thread(target=trace, daemon=True)
    thread.start()
    try:
        for i, gm in enumerate(graphs):
            assert rewrite(gm, ("replace_pattern", "rule")[i % 2], 0.5) == 2
    finally:
        stop.set()
        thread.join(60)
    assert traced[0] > 0
    for i, gm in enumerate(graphs):
        check_rewritten(gm, model, i)


def test_a_pattern_traced_while_a_model_runs_is_not_taken_for_the_models_module():
    """Stock patterns are traced when first imported, which may be inside a model's call
    (a model compiled with the fxopt backend): the model's own module frames below are no
    module of the pattern's."""
    from fxopt.patterns.tracing import PatternTracer

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            graph = PatternTracer("pattern").trace(lambda a: torch.relu(a))
            return self.linear(x), graph

    _, graph = Model()(torch.randn(1, 2))
    assert [n.op for n in graph.nodes] == ["placeholder", "call_function", "output"]


@pytest.mark.parametrize("build", ["demo", "zoo"])
def test_building_a_model_neither_seeds_nor_depends_on_the_global_generator(build):
    """The demo and zoo factories give the same weights whatever the global generator's
    state, and never seed it (process-wide: another thread's draws would repeat)."""
    from fxopt.models import demo_model
    from fxopt.testing.zoo import select

    def make():
        if build == "demo":
            return demo_model()[0]
        return select(tags=("conv",))[0].model()

    torch.manual_seed(123)
    first = make()
    state_after_first = torch.get_rng_state()
    torch.manual_seed(987)
    second = make()
    # a factory that seeded the generator would leave it in one state whatever it met
    assert not torch.equal(state_after_first, torch.get_rng_state())
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_the_python_dispatcher_of_a_symbolic_fake_run_is_not_seen_by_other_threads():
    """Fake runs on symbolic sizes switch the Python dispatcher on (``symbolic_dispatch``):
    another thread, running eager ops meanwhile, must not dispatch through it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fxopt.analysis.shapes import symbolic_dispatch

    mode = FakeTensorMode(shape_env=ShapeEnv())
    symbolic = mode.from_tensor(torch.randn(4, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    key = torch._C.DispatchKey.PythonDispatcher
    inside, entered, looked = {}, threading.Event(), threading.Event()

    def other() -> None:
        entered.wait()
        inside["other"] = torch._C._dispatch_tls_is_dispatch_key_included(key)
        looked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with symbolic_dispatch([symbolic]):
        inside["mine"] = torch._C._dispatch_tls_is_dispatch_key_included(key)
        entered.set()
        looked.wait(timeout=30)
    thread.join()
    assert inside == {"mine": True, "other": False}
    with symbolic_dispatch([torch.randn(4, 3)]):  # static sizes: nothing switched on
        assert not torch._C._dispatch_tls_is_dispatch_key_included(key)
