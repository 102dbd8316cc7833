"""CUDA-graph replay inside the backend (fxopt.compile.replay): refused wherever a replay could
differ from a plain call, one capture per call shape in a bounded LRU cache, and, on a GPU,
invisible to the caller when it happens."""

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxopt
from fxopt.compile.replay import ShapeBook, ShapeCache, describe, refusal, signature
from fxopt.errors import PassOptionError

cuda = pytest.mark.gpu


def traced(module, *shapes, device="cuda"):
    """``module`` traced, with fake parameters, buffers and example values on ``device``
    (fake CUDA tensors need no GPU; autograd on them aborts a CPU-only torch, hence no
    gradients)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty(*s, device=device) for s in shapes]
        for sub in module.modules():
            for name, p in sub._parameters.items():
                sub._parameters[name] = nn.Parameter(torch.empty(p.shape, device=device), requires_grad=False)
            for name, b in sub._buffers.items():
                sub._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    gm = torch.fx.symbolic_trace(module)
    FakeTensorProp(gm, mode).propagate(*inputs)
    return gm, inputs


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))).mean((2, 3))


def test_a_pure_inference_graph_on_cuda_is_replayable():
    gm, inputs = traced(Block().eval(), (2, 3, 8, 8))
    assert refusal(gm, inputs, training=False) is None


@pytest.mark.parametrize("forward, shapes, reason", [
    (lambda x: F.dropout(x, 0.5, True), [(4,)], "node dropout is not known to be pure"),
    (lambda x: x.add_(1), [(4,)], "node add_ writes input x"),
    (lambda x: F.hardswish(x * 2, inplace=True), [(4,)], None),  # its own intermediate
    (lambda x: x.view(2, 2), [(4,)], "output 0 shares storage with an input"),
    (lambda x: (x * 2).relu(), [(4,)], None),
    (lambda x: (lambda y: (y, y.view(2, 2)))(x * 2), [(4,)], "output 1 shares storage with another output"),
])
def test_refused_where_a_replay_could_differ(forward, shapes, reason):
    class M(nn.Module):
        def forward(self, x):
            return forward(x)

    gm, inputs = traced(M(), *shapes)
    got = refusal(gm, inputs, training=False)
    assert got == reason or (reason is not None and got is not None and got.startswith(reason)), got


def scaled(x):
    return x * 2


torch.fx.wrap("scaled")


def test_an_unknown_function_is_refused():
    class M(nn.Module):
        def forward(self, x):
            return scaled(x) + 1

    gm, inputs = traced(M(), (4,))
    assert refusal(gm, inputs, training=False).startswith("node scaled is not known to be pure")


def test_torchvision_telemetry_does_not_stop_replay():
    """torchvision's StochasticDepth calls torch._C._log_api_usage_once in forward, and
    Dynamo records the call: efficientnet and convnext were never replayed."""
    gm, inputs = traced(nn.Linear(4, 4), (2, 4))
    with gm.graph.inserting_before(gm.graph.output_node()):
        gm.graph.call_function(torch._C._log_api_usage_once, ("torchvision.ops.StochasticDepth",))
    assert refusal(gm, inputs, training=False) is None


def test_a_graph_with_symbolic_sizes_is_replayable_per_shape():
    """Dynamic shapes: the compiled function takes the batch size as an int; each concrete
    signature gets its own capture, so symbolic sizes are no reason to refuse."""
    env = ShapeEnv(allow_dynamic_output_shape_ops=True)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    batch = env.create_symintnode(env.create_symbol(4, ConstantSource("batch")), hint=4)
    with mode:
        x = torch.empty(batch, 8, device="cuda")

    class M(nn.Module):
        def forward(self, x, n):
            return (x * 2).relu().view(n, -1).sum(1)

    gm = torch.fx.symbolic_trace(M())
    FakeTensorProp(gm, mode).propagate(x, batch)
    assert not isinstance(gm.graph.output_node().args[0].meta["val"].shape[0], int)  # really symbolic
    assert refusal(gm, [x, batch], training=False) is None


def test_sizes_that_depend_on_data_are_refused():
    """masked_select's output size is data: a capture would replay the first call's size."""
    mode = FakeTensorMode(shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True), allow_non_fake_inputs=True)
    with mode:
        x = torch.empty(4, 8, device="cuda")

    class M(nn.Module):
        def forward(self, x):
            return torch.masked_select(x, x > 0) * 2

    gm = torch.fx.symbolic_trace(M())
    FakeTensorProp(gm, mode).propagate(x)
    assert refusal(gm, [x], training=False) == "node masked_select has a size that depends on data"


def test_inputs_other_than_tensors_and_sizes_are_refused():
    gm, inputs = traced(nn.Linear(4, 4), (2, 4))
    assert refusal(gm, [*inputs, 2], training=False) is None  # a size is part of the signature
    assert refusal(gm, [1.5, *inputs], training=False) == "input 0 is not a tensor or an int (float)"
    assert refusal(gm, [True, *inputs], training=False) == "input 0 is not a tensor or an int (bool)"


def test_a_cpu_output_is_refused():
    class M(nn.Module):
        def forward(self, x):
            return (x * 2).cpu()

    gm, inputs = traced(M(), (4,))
    assert refusal(gm, inputs, training=False) == "output 0 is not a CUDA tensor"


# --- the shape cache (the replay's keying and eviction, without CUDA) -----------------------

def test_the_signature_tells_apart_every_thing_a_capture_is_fixed_to():
    x = torch.randn(4, 3, 8, 8)
    base = signature([x, 4])
    assert base == signature([torch.randn(4, 3, 8, 8), 4])  # values do not matter
    for other in ([torch.randn(2, 3, 8, 8), 4], [x.contiguous(memory_format=torch.channels_last), 4],
                  [x.half(), 4], [x, 5], [x, True], [x]):
        assert signature(other) != base, other
    assert signature([x, [1]]) is None
    assert signature([x, 4.0]) is None  # refusal admits no float input: no capture is keyed by one
    assert describe(signature([x, 4])) == "float32[4, 3, 8, 8]/(192, 64, 8, 1), 4"


def test_the_shape_cache_evicts_the_least_recently_used():
    cache = ShapeCache(2)
    assert cache.insert("a", 1) is None and cache.insert("b", 2) is None
    assert cache.get("a") == 1  # a is now the most recently used
    assert cache.insert("c", 3) == ("b", 2)
    assert list(cache.entries) == ["a", "c"] and cache.get("b") is None


def test_an_evicted_shape_is_refused_while_the_cache_is_full():
    """Coming back after eviction shows a working set over the bound: re-capturing would
    thrash, so it runs plainly until there is room."""
    cache = ShapeCache(2)
    cache.insert("a", 1)
    cache.insert("b", 2)
    cache.insert("c", 3)  # evicts a
    assert not cache.admits("a")
    with pytest.raises(ValueError, match="evicted before"):
        cache.insert("a", 1)
    assert cache.admits("d")  # a new shape still evicts the least recently used
    cache.entries.pop("b")
    assert cache.admits("a") and cache.insert("a", 1) is None and "a" not in cache.evicted


def test_the_shape_cache_remembers_a_bounded_number_of_evicted_keys():
    cache = ShapeCache(1, memory=2)
    for key in "abcd":
        cache.insert(key, key)
    assert list(cache.evicted) == ["b", "c"] and cache.admits("a")
    with pytest.raises(ValueError, match="at least one"):
        ShapeCache(0)


def test_the_book_logs_first_calls_evictions_and_the_bound_with_a_warning():
    """What GraphReplay runs for each signature, decided without a GPU: first calls run
    plainly; a new shape that comes back to a full cache evicts the least recently used;
    an evicted shape coming back to a full cache runs plainly, visibly (a warning, once,
    and the log)."""
    book = ShapeBook(2)
    keys = [signature([torch.empty(b, 4)]) for b in (2, 3, 4)]
    entry, first = book.lookup(keys[0])
    assert first and book.lookup(keys[0]) == (entry, False)  # the second call: capture it
    book.lookup(keys[1])
    assert book.lookup(keys[2]) == (None, False)  # seen once: plain, nothing evicted
    entry, first = book.lookup(keys[2])  # back: evicts keys[0], captured at once
    assert entry is not None and not first and list(book.cache.entries) == keys[1:]
    with pytest.warns(RuntimeWarning, match="replay_shapes=2"):
        assert book.lookup(keys[0]) == (None, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per graph
        assert book.lookup(keys[0]) == (None, False)
    log = book.log
    assert (log.evictions, log.at_bound, log.in_capture) == (1, 2, 0)
    assert list(log.shapes) == [describe(k) for k in keys]
    assert log.shapes[describe(keys[0])].startswith("plain: the cache of 2 captured shapes is full")
    assert log.shapes[describe(keys[2])] == "came back: captured"
    assert "1 eviction(s), 2 call(s) plain at the bound of 2 shapes" in str(log)


def test_a_shape_seen_once_at_a_full_cache_evicts_no_capture():
    """Epochs of full batches, each ending with a partial one: the partial batch runs
    plainly every epoch and never evicts the capture the full batches keep using."""
    book = ShapeBook(1)
    full, last = signature([torch.empty(32, 4)]), signature([torch.empty(7, 4)])
    entry, _ = book.lookup(full)
    for _epoch in range(3):
        assert book.lookup(full) == (entry, False)
        assert book.lookup(last) == (None, False)  # the one-off runs plainly
        assert list(book.cache.entries) == [full]
    assert book.log.evictions == 0
    assert book.log.shapes[describe(last)].startswith("plain: the cache of 1 captured shapes is full and in use")


def test_a_waiting_shape_is_captured_when_it_is_more_recent_than_the_least_recent_capture():
    """Bound 2, captures a and b: c waits; after a is used again, c comes back while b, now
    the least recently used, has not been: c takes b's place. The waiting list is bounded."""
    book = ShapeBook(2)
    a, b, c, *others = (signature([torch.empty(n, 4)]) for n in range(1, 8))
    for key in (a, a, b, b):
        book.lookup(key)
    assert book.lookup(c) == (None, False)
    book.lookup(a)  # b is now the least recently used, and unused since c's call
    entry, first = book.lookup(c)
    assert entry is not None and not first and list(book.cache.entries) == [a, c]
    book.cache.memory = 2
    for key in others:
        assert book.lookup(key) == (None, False)
    assert list(book.waiting) == others[-2:]


def test_training_and_cpu_inputs_are_refused():
    gm, inputs = traced(nn.Linear(4, 4), (2, 4))
    assert refusal(gm, inputs, training=True).startswith("a training graph")
    gm, inputs = traced(Block().eval(), (2, 3, 8, 8), device="cpu")
    assert refusal(gm, inputs, training=False) == "input 0 is on cpu"


def test_the_backend_records_why_a_cpu_graph_is_not_replayed():
    reports = []
    model, x = Block().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        out = torch.compile(model, backend="fxopt", options={"reports": reports})(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert [r.no_replay for r in reports] == ["input 0 is on cpu"]


def test_sizes_of_a_dynamic_graph_are_no_reason_to_refuse():
    """dynamic=True: the compiled function takes the sizes as its first inputs; on CPU the
    reason given is the tensor's device, not the ints before it."""
    reports = []
    model, x = Block().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad(), warnings.catch_warnings():
        # Dynamo restarts the trace to specialize the mean's divisor: no fallback to warn of
        warnings.simplefilter("error", RuntimeWarning)
        out = torch.compile(model, backend="fxopt", dynamic=True, options={"reports": reports})(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert len(reports) == 1 and reports[0].replay is None
    assert re.fullmatch(r"input [1-9] is on cpu", reports[0].no_replay), reports[0].no_replay


@pytest.mark.parametrize("options, match", [({"cuda_graphs": "yes"}, "cuda_graphs"),
                                            ({"replay_shapes": 0}, "replay_shapes"),
                                            ({"replay_shapes": True}, "replay_shapes"),
                                            ({"replay_shapes": 2.0}, "replay_shapes")])
def test_the_options_are_checked(options, match):
    with pytest.raises(PassOptionError, match=match):
        fxopt.compile(Block(), options=options)


# --- on a GPU ---------------------------------------------------------------------------

def compiled_block(**options):
    torch._dynamo.reset()
    model = Block().cuda().eval()
    reports: list = []
    return model, torch.compile(model, backend="fxopt", options={"reports": reports, **options}), reports


@cuda
def test_replay_returns_fresh_correct_outputs_for_every_input():
    model, fn, reports = compiled_block()
    with torch.no_grad():
        xs = [torch.randn(4, 3, 16, 16, device="cuda") for _ in range(5)]
        outs = [fn(x) for x in xs]  # call 1 plain, call 2 captures, calls 3-5 replay
        assert [r.no_replay for r in reports] == [None]
        assert [s.split(" ")[0] for s in reports[0].replay.shapes.values()] == ["replayed"]
        for x, out in zip(xs, outs):  # no later call overwrote an earlier output
            torch.testing.assert_close(out, model(x), rtol=1e-3, atol=1e-4)
        assert len({o.data_ptr() for o in outs}) == len(outs)
        outs[-1].add_(1)  # the caller owns its output: the next call is not affected
        torch.testing.assert_close(fn(xs[0]), model(xs[0]), rtol=1e-3, atol=1e-4)


@cuda
def test_other_strides_run_plainly_and_the_callers_capture_still_works():
    model, fn, _ = compiled_block()
    with torch.no_grad():
        x = torch.randn(4, 3, 16, 16, device="cuda")
        for _ in range(3):
            fn(x)
        odd = torch.randn(4, 3, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(fn(odd), model(odd), rtol=1e-3, atol=1e-4)
        static = torch.randn(4, 3, 16, 16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the caller's own capture: no nested capture inside
            out = fn(static)
        static.copy_(x)
        graph.replay()
        torch.testing.assert_close(out, model(x), rtol=1e-3, atol=1e-4)


@cuda
def test_an_input_whose_elements_overlap_runs_plainly():
    """An expanded input cannot be copied into a buffer of its strides: that shape runs
    plainly, says why, and the call still returns eager's result."""
    torch._dynamo.reset()
    model = nn.Linear(16, 8).cuda().eval()
    reports: list = []
    fn = torch.compile(model, backend="fxopt", options={"reports": reports})
    row = torch.randn(1, 16, device="cuda")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="could not be captured"):
        outs = [fn(row.expand(4, 16)) for _ in range(3)]
    with torch.no_grad():
        for out in outs:
            torch.testing.assert_close(out, model(row.expand(4, 16)), rtol=1e-3, atol=1e-4)
    assert "capture failed" in str(reports[-1].replay)


@cuda
def test_random_graphs_are_not_replayed_and_stay_random():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).cuda().train()
    reports: list = []
    fn = torch.compile(model, backend="fxopt", options={"reports": reports})
    x = torch.randn(64, 8, device="cuda")
    with torch.no_grad():
        outs = [fn(x) for _ in range(4)]
    assert "dropout" in reports[0].no_replay
    assert not torch.equal(outs[2], outs[3])


@pytest.mark.parametrize("options, reason", [
    ({"cuda_graphs": False}, "cuda_graphs=False"),
    ({"mode": "reduce-overhead"}, "Inductor captures its own CUDA graphs (mode='reduce-overhead')"),
])
def test_the_backend_says_when_replay_is_switched_off(options, reason):
    """Decided at compile time, before the inputs' device is looked at: the same on CPU."""
    reports: list = []
    model, x = Block().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        out = torch.compile(model, backend="fxopt", options={"reports": reports, **options})(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert [r.no_replay for r in reports] == [reason] and reports[0].replay is None


@cuda
def test_a_gpu_bound_graph_whose_copies_cost_more_than_its_launches_runs_plainly():
    """One memory-bound kernel over 256 MB: a replay adds a copy in and a clone out, each
    as long as the kernel, and saves one launch, so the timing at capture must refuse it."""
    torch._dynamo.reset()
    reports: list = []
    fn = torch.compile(lambda x: torch.sin(x) * 2, backend="fxopt", options={"reports": reports})
    x = torch.randn(64 * 2**20, device="cuda")
    with torch.no_grad():
        outs = [fn(x) for _ in range(4)]
    assert reports[0].no_replay is None
    assert list(reports[0].replay.shapes.values())[0].startswith("plain: plain launches timed faster")
    for out in outs:
        torch.testing.assert_close(out, torch.sin(x) * 2)


def serve(fn, model, batches, route=None):
    """Calls of ``fn`` at each batch size in turn (fresh inputs each), every output kept
    and checked against eager at the end: no later call, of any shape, overwrote it."""
    calls = []
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, 3, 16, 16, device="cuda")
            if route == "mark_dynamic":
                torch._dynamo.mark_dynamic(x, 0)
            calls.append((x, fn(x)))
        for x, out in calls:
            torch.testing.assert_close(out, model(x), rtol=1e-3, atol=1e-4)
    assert len({out.data_ptr() for _, out in calls}) == len(calls)
    return calls


@cuda
@pytest.mark.parametrize("route", ["automatic", "dynamic=True", "mark_dynamic"])
def test_varying_batch_sizes_keep_the_replay(route):
    """Serving at several batch sizes: the graph Dynamo compiles with a symbolic batch
    size is replayed, one capture per size, in one shared pool, and stays invisible."""
    torch._dynamo.reset()
    model = Block().cuda().eval()
    reports: list = []
    fn = torch.compile(model, backend="fxopt", dynamic=True if route == "dynamic=True" else None,
                       options={"reports": reports})
    serve(fn, model, [4, 4, 2, 2, 3, 3, 4, 2, 3, 4, 2, 3, 4, 4], route)
    dynamic = [r for r in reports if r.replay is not None and len(r.replay.shapes) > 1]
    assert len(dynamic) == 1, [str(r.replay) for r in reports]
    log = dynamic[0].replay
    assert all(status.startswith("replayed") for status in log.shapes.values()), str(log)
    assert log.evictions == log.at_bound == 0


@cuda
def test_the_bound_evicts_and_then_runs_plainly():
    torch._dynamo.reset()
    model = Block().cuda().eval()
    reports: list = []
    fn = torch.compile(model, backend="fxopt", dynamic=True, options={"reports": reports, "replay_shapes": 2})
    with pytest.warns(RuntimeWarning, match="replay_shapes=2"):
        serve(fn, model, [2, 2, 3, 3, 4, 4, 4, 2, 2, 3])  # 4 evicts 2; 2 comes back: plain
    log = reports[0].replay
    assert log.evictions == 1 and log.at_bound == 2, str(log)
    statuses = list(log.shapes.values())
    assert statuses[0].startswith("plain: the cache of 2 captured shapes is full"), str(log)
    assert [s.split(" ")[0] for s in statuses[1:]] == ["replayed", "replayed"], str(log)


@cuda
def test_the_callers_capture_and_other_streams_run_correctly():
    torch._dynamo.reset()
    model = Block().cuda().eval()
    reports: list = []
    fn = torch.compile(model, backend="fxopt", dynamic=True, options={"reports": reports})
    serve(fn, model, [2, 2, 3, 3])
    with torch.no_grad():
        static = torch.randn(2, 3, 16, 16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the caller's own capture: no nested capture inside
            out = fn(static)
        x = torch.randn(2, 3, 16, 16, device="cuda")
        static.copy_(x)
        graph.replay()
        torch.testing.assert_close(out, model(x), rtol=1e-3, atol=1e-4)
        assert reports[0].replay.in_capture == 1
        side = torch.cuda.Stream()
        xs = [torch.randn(b, 3, 16, 16, device="cuda") for b in (2, 3, 2, 3)]
        side.wait_stream(torch.cuda.current_stream())  # the inputs are ready on both
        outs = []
        for i, x in enumerate(xs):  # replays alternate between two streams, unsynchronized
            with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
                outs.append(fn(x))
        torch.cuda.synchronize()
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, model(x), rtol=1e-3, atol=1e-4)
