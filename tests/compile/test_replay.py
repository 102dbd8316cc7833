"""CUDA-graph replay inside the backend (fxopt.replay): refused wherever a replay could
differ from a plain call, and, on a GPU, invisible to the caller when it happens."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxopt
from fxopt.errors import PassOptionError
from fxopt.replay import refusal

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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


def test_the_option_is_checked():
    with pytest.raises(PassOptionError, match="cuda_graphs"):
        fxopt.compile(Block(), options={"cuda_graphs": "yes"})


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


@cuda
def test_cuda_graphs_false_turns_replay_off():
    _, fn, reports = compiled_block(cuda_graphs=False)
    with torch.no_grad():
        fn(torch.randn(4, 3, 16, 16, device="cuda"))
    assert [r.no_replay for r in reports] == ["cuda_graphs=False"]


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
    assert reports[0].no_replay.startswith("plain launches timed faster")
    for out in outs:
        torch.testing.assert_close(out, torch.sin(x) * 2)
