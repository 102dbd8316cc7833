"""fxopt.profile on the CPU: ranking, time accounting, memory, side effects, errors."""

import json

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.profiler import ProfilerActivity

import fxopt
from fxopt.profiling import op_kind, profile


class OneBigMatmul(nn.Module):
    """A 1536x1536 @ 1536x1536 matmul (7 GFLOP) among pointwise ops on 16 numbers: dominant
    by far more than a scheduler preemption on a loaded box can add to a small node."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(1536, 1536))

    def forward(self, x, small):
        s = torch.relu(small) + 1
        s = s * 2
        big = torch.mm(x, self.w)
        s = torch.sigmoid(s)
        return big.sum() + s.sum()


class MLP(nn.Module):
    """Big enough (several ms per run) that per-node times are not dominated by noise."""

    def __init__(self, width=768, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def test_the_dominant_node_ranks_first():
    gm = fx.symbolic_trace(OneBigMatmul())
    result = profile(gm, (torch.randn(1536, 1536), torch.randn(16)), warmup=1, repeat=3)
    top = result.hotspots(3)
    assert top[0]["node"] == "mm"
    assert top[0]["kind"] == "matmul"
    assert top[0]["flops"] == 2 * 1536**3  # from torch.utils.flop_counter
    assert result["relu"].flops is None  # a pointwise op has no FLOP formula there
    kinds = {row["kind"]: row for row in result.by_kind()}
    assert kinds["matmul"]["nodes"] == 1 and kinds["pointwise"]["nodes"] >= 3


def test_node_times_add_up_to_the_end_to_end_time():
    gm = fx.symbolic_trace(MLP().eval())
    x = torch.randn(256, 768)
    with torch.no_grad():
        results = [profile(gm, (x,), warmup=1, repeat=3) for _ in range(3)]
    # within the profiled runs the node ranges cover the run: nothing is unaccounted for
    # (the best of three: on a loaded box the process can be preempted between two nodes)
    result = max(results, key=lambda r: r.node_time_s / r.total_s)
    assert 0.9 * result.total_s <= result.node_time_s <= result.total_s
    # and the plain generated code, timed separately, takes about as long. This box is two
    # cores shared by many jobs (identical runs of this model measured 8 to 258 ms), so the
    # fastest of three profiles is compared with the fastest plain timing, and the bound
    # only catches gross accounting errors (a run counted 3 times, a missing division); the
    # 10 % figure is measured by bench/profile_gpu.py
    # A systematic error fails every round; preemption rarely spoils three rounds in a row
    # (CI once saw a plain-call minimum of 51 ms against 12 ms of node time).
    for _ in range(3):
        node_s = min(r.node_time_s for r in results)
        eager_s = min(r.eager_s for r in results)
        if eager_s / 3 <= node_s <= 3 * eager_s:
            break
        with torch.no_grad():
            results += [profile(gm, (x,), warmup=1, repeat=3) for _ in range(3)]
    assert eager_s / 3 <= node_s <= 3 * eager_s
    assert sum(n.share for n in result.nodes) == pytest.approx(1.0)
    layers = [n for n in result.nodes if n.kind == "matmul"]
    assert len(layers) == 4 and sum(n.share for n in layers) > 0.5


def _peak_from_torch_profiler(gm, inputs):
    """The peak of the allocations the CPU profiler records for a plain call."""
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        gm(*inputs)
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_memory_curve_peak_matches_the_profilers_memory_events():
    gm = fx.symbolic_trace(MLP(width=512, depth=3).eval())
    x = torch.randn(128, 512)
    with torch.no_grad():
        result = profile(gm, (x,), warmup=1, repeat=2)
        reference = _peak_from_torch_profiler(gm, (x,))
    assert result.peak_bytes == pytest.approx(reference, rel=0.05)
    curve = result.curve()
    assert [name for name, _, _ in curve] == [n.name for n in gm.graph.nodes]
    assert max(peak for _, _, peak in curve) == result.peak_bytes
    # the output is what is live at the end: 128 x 512 floats
    assert curve[-1][1] == 128 * 512 * 4
    # the liveness analysis predicts at least the activations it can see
    assert result.predicted_bytes is not None and max(result.predicted_bytes) >= 2 * 128 * 512 * 4


class TrainingBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        x.mul_(2)  # writes its input in place
        return torch.relu(self.bn(self.conv(x)))


def test_parameters_buffers_and_inputs_are_left_as_they_were():
    model = TrainingBN().train()
    gm = fx.symbolic_trace(model)
    state = {k: v.clone() for k, v in gm.state_dict().items()}
    x = torch.randn(2, 3, 12, 12)
    x_before = x.clone()
    rng = torch.random.get_rng_state()
    expected = gm(x.clone())  # one eager call, on a copy
    for k, v in state.items():  # undo that call's running-stat update for the comparison
        gm.state_dict()[k].copy_(v)
    profile(gm, (x,), warmup=2, repeat=3)
    for k, v in gm.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(x, x_before)
    assert torch.equal(torch.random.get_rng_state(), rng)
    torch.testing.assert_close(gm(x.clone()), expected)


def test_a_graph_that_cannot_run_names_the_node():
    gm = fx.symbolic_trace(MLP(width=64, depth=2))
    weights = {k: v.clone() for k, v in gm.state_dict().items()}
    with pytest.raises(fxopt.ProfileError) as info:
        profile(gm, (torch.randn(4, 32),))
    assert info.value.node == "layers_0"
    assert "layers_0" in str(info.value)
    assert all(torch.equal(v, weights[k]) for k, v in gm.state_dict().items())
    with pytest.raises(fxopt.InputError):
        profile(gm, torch.randn(4, 64))  # not a tuple


def test_trace_is_chrome_json_with_node_slices(tmp_path):
    gm = fx.symbolic_trace(MLP(width=64, depth=2))
    result = profile(gm, (torch.randn(4, 64),), warmup=0, repeat=1)
    path = result.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    # what Perfetto's JSON importer needs of a complete event: numeric ts/dur, pid and tid
    for e in complete:
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert "pid" in e and "tid" in e and isinstance(e["name"], str)
    slices = {e["name"] for e in complete}
    assert {f"fxopt::{n.name}" for n in gm.graph.nodes} <= slices
    assert "aten::linear" in slices
    # every node slice lies inside the run's slice on the same thread (a nested track)
    run = next(e for e in complete if e["name"] == "fxopt.run")
    for e in complete:
        if e["name"].startswith("fxopt::"):
            assert e["tid"] == run["tid"]
            assert run["ts"] <= e["ts"] and e["ts"] + e["dur"] <= run["ts"] + run["dur"] + 1


class ShapeBranch(nn.Module):
    """symbolic_trace cannot follow a branch on a shape; torch.export specializes it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        if x.shape[0] > 2:
            return torch.relu(self.linear(x))
        return x


def test_a_module_symbolic_trace_cannot_follow_is_exported():
    model = ShapeBranch().eval()
    with pytest.raises(torch.fx.proxy.TraceError):
        fx.symbolic_trace(model)
    x = torch.randn(4, 16)
    result = profile(model, (x,), warmup=0, repeat=1)
    assert [n.kind for n in result.nodes if n.op == "call_function"][:2] == ["matmul", "pointwise"]
    with pytest.raises(fxopt.TraceError, match="torch.export"):
        profile(model, ("not a tensor",), warmup=0, repeat=1)


class LongNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder_with_a_long_name = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))  # noqa: E501

    def forward(self, x):
        return self.encoder_with_a_long_name(x)


def test_csv_rows():
    gm = fx.symbolic_trace(MLP(width=64, depth=2))
    result = profile(gm, (torch.randn(4, 64),), warmup=0, repeat=1)
    lines = result.to_csv().splitlines()
    assert lines[0].startswith("node,op,target,kind")
    assert len(lines) == 1 + len(gm.graph.nodes)
    assert result.to_csv(by="kind").splitlines()[0].startswith("kind,")
    assert max(len(line) for line in result.table().splitlines()) <= 100
    long_names = profile(fx.symbolic_trace(LongNames()), (torch.randn(1, 8),), repeat=1)
    assert max(len(n.name) for n in long_names.nodes) > 26  # clipped in the table
    assert max(len(line) for line in long_names.table().splitlines()) <= 100


@pytest.mark.parametrize(("name", "kind"), [
    ("aten::conv2d", "conv"), ("aten::addmm", "matmul"), ("aten::linear", "matmul"),
    ("aten::layer_norm", "norm"), ("aten::relu", "pointwise"), ("aten::sum", "reduction"),
    ("aten::permute", "copy/layout"), ("aten::copy_", "copy/layout"), ("aten::empty", "other"),
])
def test_op_kinds(name, kind):
    assert op_kind(name) == kind


class _Torch211Event:
    """A profiler event with only the methods torch 2.11's ``_KinetoEvent`` has (no
    ``activity_type``, added later): the GPU machine runs torch 2.11."""

    _API = {"name", "device_type", "start_ns", "end_ns", "duration_ns", "correlation_id",
            "linked_correlation_id", "is_user_annotation", "is_async", "nbytes", "device_index"}

    def __init__(self, event):
        self._event = event

    def __getattr__(self, attr):
        if attr not in self._API:
            raise AttributeError(f"torch 2.11's _KinetoEvent has no {attr!r}")
        return getattr(self._event, attr)


def test_events_are_read_with_the_methods_torch_2_11_has():
    from fxopt.profiling.events import parse_runs

    gm = fx.symbolic_trace(MLP(width=64, depth=2))
    result = profile(gm, (torch.randn(4, 64),), warmup=0, repeat=2)
    events = result.profiler.profiler.kineto_results.events()
    names = [n.name for n in gm.graph.nodes]
    narrow = parse_runs([_Torch211Event(e) for e in events], names, "cpu")
    full = parse_runs(events, names, "cpu")
    assert narrow == full
    assert [n for n in names if full[0].nodes[n].ops][:1] == ["layers_0"]
    assert "aten::linear" in full[0].nodes["layers_0"].ops
