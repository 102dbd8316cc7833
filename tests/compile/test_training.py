"""Training steps through the backend: which graphs may be replayed (fxopt.compile.training), the
memory budget (fxopt.memory.budget), and, on a GPU, that a replayed step is a plain step."""

import copy
import inspect
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fxopt
from fxopt.compile.freezing import work_copy
from fxopt.compile.training import PlainOutputs, fresh_outputs, refusal, training_route
from fxopt.errors import PassOptionError

cuda = pytest.mark.gpu


def make_fx_graph(fn, *shapes, device="cuda"):
    """``fn`` traced to ATen on fake ``device`` tensors (no GPU needed): meta['val'] on every node."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty(*s, device=device) for s in shapes]
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(*inputs)
    return gm, [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]


def state(*names):
    return lambda node: node.name in names


@pytest.mark.parametrize("fn, shapes, is_state, reason", [
    (lambda w, g: w.add_(g, alpha=-0.1), [(4,), (4,)], ("w_1",), None),          # an SGD update
    (lambda w, g: w.add_(g, alpha=-0.1), [(4,), (4,)], (), "writes input w_1"),    # the caller's tensor
    (lambda x: F.dropout(x, 0.5, True) * 2, [(4,)], (), None),  # graph-safe Philox: draws as plain calls
    (lambda x: x * 2, [(4,)], (), None),
    (lambda x, m: (x - m).relu(), [(4,), (4,)], (), None),
    # cloned apart, two views of one tensor would no longer alias as eager's do
    (lambda x: (lambda h: (h, h.view(2, 2)))(x * 2), [(4,)], (), "output 1 shares storage with another output"),
])
def test_refused_where_a_training_replay_could_differ(fn, shapes, is_state, reason):
    gm, inputs = make_fx_graph(fn, *shapes)
    found = refusal(gm, inputs, is_state=state(*is_state))
    assert (found is None) if reason is None else (reason in found), found


def test_a_collective_is_refused():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("no torch.distributed")
    gm, inputs = make_fx_graph(lambda x: torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x, "sum", "0")), (4,))
    assert "is a collective" in refusal(gm, inputs, is_state=state())


def test_cpu_inputs_are_refused():
    gm, inputs = make_fx_graph(lambda x: x * 2, (4,), device="cpu")
    assert "is on cpu" in refusal(gm, inputs, is_state=state())


def test_dynamic_shapes_are_replayed_as_the_trees_do_once_per_shape():
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.empty(4, 2))
    assert refusal(gm, [], is_state=state()) is None
    written = torch.fx.experimental.proxy_tensor.make_fx(lambda x: x.mul_(2), tracing_mode="symbolic")(torch.empty(4, 2))
    assert "writes input" in refusal(written, [], is_state=state())


def test_the_training_route_takes_trained_graphs_and_optimizer_updates_only():
    update, _ = make_fx_graph(lambda w, g: w.add_(g, alpha=-0.1), (4,), (4,))
    pure, _ = make_fx_graph(lambda w, x: x @ w, (4, 4), (2, 4))
    assert training_route(pure, training=True, is_state=state())
    assert training_route(update, training=False, is_state=state("w_1"))
    assert not training_route(update, training=False, is_state=state())  # writes a user input
    assert not training_route(pure, training=False, is_state=state("w_1"))


def test_plain_outputs_clones_the_graphs_own_outputs_and_keeps_views_of_inputs():
    gm, _ = make_fx_graph(lambda x: (x * 2, x.view(2, 2)), (4,), device="cpu")
    assert fresh_outputs(gm) == [True, False]
    pool = torch.arange(4.0)
    x = torch.ones(4)
    compiled = PlainOutputs(lambda x: [pool, x.view(2, 2)], fresh_outputs(gm))
    fresh, view = compiled(x)
    assert fresh is not pool and torch.equal(fresh, pool)
    assert fresh.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _inductor_in_plain_outputs(seen=None):
    """A backend: Inductor's compiled graph inside the wrapper of a replayed training graph,
    without CUDA graphs (what runs around the trees' replay, on the CPU); ``seen`` gets the
    arguments each call hands Inductor's code."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        compiled = compile_fx(gm, example_inputs)

        def call(*args):
            if seen is not None:
                seen.append(args)
            return compiled(*args)

        return PlainOutputs(call, fresh_outputs(work_copy(gm)))

    return backend


class _Mlp(nn.Module):
    def __init__(self, view):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
        self.view = view

    def forward(self, x):
        h = self.body(x)
        # a view of an intermediate: AOTAutograd regenerates it outside its autograd node
        return h.view(-1) if self.view else (h, h.relu())


def _loss(out):
    return out.square().sum() if isinstance(out, torch.Tensor) else out[0].square().sum() + out[1].sum()


@pytest.mark.parametrize("view", [False, True], ids=["outputs", "view-of-intermediate"])
def test_around_aot_autograd_the_gradients_handed_to_grad_are_the_ones_the_hook_noted(view):
    """``.backward()``: every parameter's gradient stolen into ``.grad`` is one that the hook
    on the compiled graph's backward node noted (so it is copied before a later replay), and
    the gradients are eager's."""
    from fxopt.compile import training

    torch.manual_seed(0)
    model = _Mlp(view)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=_inductor_in_plain_outputs())
    for _ in range(2):
        x = torch.randn(5, 6)
        _loss(compiled(x)).backward()
        _loss(eager(x)).backward()
        noted = {id(leaf()): ptr for leaf, ptr in training._PENDING.grads}
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            assert noted[id(p)] == p.grad.data_ptr()
        for m in (model, eager):
            m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("view", [False, True], ids=["outputs", "view-of-intermediate"])
@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
def test_around_aot_autograd_a_partial_backward_gets_copies_equal_to_eager(view, how):
    """``torch.autograd.grad`` and ``.backward(inputs=...)`` run only part of the graph: the
    hook copies every gradient (nothing is noted for a later replay to copy)."""
    from fxopt.compile import training

    torch.manual_seed(0)
    model = _Mlp(view)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=_inductor_in_plain_outputs())
    x = torch.randn(5, 6)
    loss = _loss(compiled(x))
    before = list(training._PENDING.grads)
    params, eager_params = list(model.parameters())[:2], list(eager.parameters())[:2]
    if how == "autograd.grad":
        got = torch.autograd.grad(loss, params)
        assert all(p.grad is None for p in model.parameters())
    else:
        loss.backward(inputs=params)
        got = [p.grad for p in params]
    want = torch.autograd.grad(_loss(eager(x)), eager_params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert training._PENDING.grads == before


def test_a_backward_inside_a_compiled_step_runs_the_hook_untraced():
    """A step compiled whole runs its backward inside Dynamo's frame (on the CPU, on the
    calling thread): Dynamo must not compile the gradient hook (it did, with the engine's
    queries as graph calls), and the step still trains as eager does."""
    from fxopt.compile import training

    torch.manual_seed(0)
    model = _Mlp(False)
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]

    def step(m, opt, x):
        _loss(m(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    compiled = torch.compile(step, backend=_inductor_in_plain_outputs())
    for _ in range(3):
        x = torch.randn(5, 6)
        compiled(model, opts[0], x)
        step(eager, opts[1], x)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    hook = inspect.unwrap(training._grads_out_of_pool)
    assert torch._C._dynamo.eval_frame._debug_get_cache_entry_list(hook.__code__) == []


def test_the_compiled_graph_gets_the_callers_parameters_themselves():
    """No autograd node per input on the way in (one view per parameter and call cost
    ~1.4 us each on a 2-core CPU): the compiled code takes the very parameters."""
    seen = []
    model = _Mlp(False)
    compiled = torch.compile(model, backend=_inductor_in_plain_outputs(seen))
    out = compiled(torch.randn(5, 6))
    params = set(map(id, model.parameters()))
    assert seen and params <= {id(a) for a in seen[-1]}
    assert all(o.requires_grad and o.grad_fn is not None for o in out)


def test_the_work_copy_keeps_dynamo_metadata_that_aot_autograd_reads():
    seen = {}

    def backend(gm, inputs):
        seen["gm"], seen["work"] = gm, work_copy(gm)
        return gm.forward

    torch.compile(nn.Linear(4, 2), backend=backend)(torch.randn(3, 4)).sum().backward()
    assert seen["gm"]._param_name_to_source  # what Dynamo hands over: the sources of its inputs
    assert seen["work"]._param_name_to_source is seen["gm"]._param_name_to_source


class Net(nn.Module):
    """Conv, batch norm (running statistics), dropout: every kind of training state."""

    def __init__(self, p=0.0):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 32, 1)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.bn(self.conv(x)))))
        return self.head(self.drop(h.mean((2, 3))))


def train(model, steps, options=None, device="cpu", seed=0):
    """``steps`` SGD steps, compiled whole by fxopt (or eager): losses, the model after."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    fn = step if options is None else fxopt.compile(step, options=options)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=gen).to(device), torch.randint(0, 5, (4,), generator=gen).to(device))
               for _ in range(steps)]
    torch.manual_seed(seed)
    return [fn(x, y) for x, y in batches], model


def test_a_compiled_training_step_on_cpu_runs_plainly_and_matches_eager():
    torch.manual_seed(0)
    net = Net()
    reports = []
    eager, eager_model = train(net, 3)
    got, model = train(net, 3, {"reports": reports})
    torch.testing.assert_close(torch.stack(got), torch.stack(eager), rtol=1e-5, atol=1e-5)
    for p, q in zip(model.state_dict().values(), eager_model.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert reports and all("is on cpu" in r.no_replay for r in reports)
    update = [r for r in reports if not r.training]
    assert update, "the optimizer's update is a graph of its own"
    # an optimizer update writes its weights: they are never constants
    assert all(r.frozen == [] and "pad_conv_channels" not in [x.name for x in r.report.records] for r in update)


def test_training_cuda_graphs_must_be_a_bool_or_none():
    with pytest.raises(PassOptionError, match="training_cuda_graphs"):
        fxopt.compile(nn.Linear(2, 2), options={"training_cuda_graphs": "yes"})
    fxopt.compile(nn.Linear(2, 2), options={"training_cuda_graphs": None})


def test_training_replay_asked_for_where_it_cannot_apply_warns_naming_the_option():
    """The default replays wherever it can, silently; asked for by name, a refusal says so."""
    with pytest.warns(RuntimeWarning, match=r"training_cuda_graphs=True does not apply .* is on cpu"):
        train(Net(), 1, {"training_cuda_graphs": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train(Net(), 1, {})


# --- on a GPU -----------------------------------------------------------------------------

@cuda
def test_a_replayed_training_step_is_a_plain_step():
    torch.manual_seed(0)
    net = Net()
    reports = []
    plain, plain_model = train(net, 4, {"cuda_graphs": False}, device="cuda")
    torch._dynamo.reset()
    got, model = train(net, 4, {"reports": reports}, device="cuda")
    # two compiles may pick different cuDNN algorithms: equal up to float32 rounding
    torch.testing.assert_close(torch.stack(got), torch.stack(plain), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.state_dict().values(), plain_model.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert reports and all(r.no_replay is None for r in reports), [r.no_replay for r in reports]


@cuda
def test_outputs_kept_across_replayed_steps_are_not_overwritten():
    torch.manual_seed(0)
    model = Net().cuda()
    compiled = fxopt.compile(model)
    outs, copies = [], []
    for _ in range(4):
        out = compiled(torch.randn(4, 3, 8, 8, device="cuda"))
        out.sum().backward()
        outs.append(out.detach())  # what a loop keeps: logits, a loss
        copies.append(out.detach().clone())
        del out  # its autograd graph must not live into the next forward (docs/compile.md)
    for out, kept in zip(outs, copies):
        assert torch.equal(out, kept)


@pytest.mark.parametrize(("options", "reason"), [({}, "is on cpu"),
                                                 ({"training_cuda_graphs": False}, "training_cuda_graphs=False"),
                                                 ({"cuda_graphs": False}, "cuda_graphs=False")])
def test_training_replay_is_on_by_default_and_either_option_turns_it_off(options, reason):
    reports = []
    train(Net(), 1, {"reports": reports, **options})
    trained = [r for r in reports if r.training]
    assert trained and all(reason in r.no_replay for r in trained), [r.no_replay for r in trained]


@cuda
def test_dropout_draws_replayed_are_the_plain_draws():
    torch.manual_seed(0)
    net, reports = Net(p=0.5), []
    plain, _ = train(net, 4, {"cuda_graphs": False}, device="cuda", seed=3)
    torch._dynamo.reset()
    got, _ = train(net, 4, {"reports": reports}, device="cuda", seed=3)
    assert all(r.no_replay is None for r in reports), [r.no_replay for r in reports]
    # another mask would move the loss far more than cuDNN's choice of algorithm does
    torch.testing.assert_close(torch.stack(got), torch.stack(plain), rtol=1e-5, atol=1e-6)
def test_an_evaluation_between_steps_sees_the_weights_the_steps_wrote():
    """Inference graphs freeze weights (conv-BN folded into new constants): once a step
    writes the weights, the frozen graph must not run stale ones."""
    torch.manual_seed(0)
    model = Net().eval()
    eager = copy.deepcopy(model)
    reports = []
    compiled = fxopt.compile(model, options={"reports": reports})
    x = torch.randn(2, 3, 8, 8)
    for step in range(3):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
            for m in (model, eager):  # what an optimizer step and a BN update do: write in place
                for t in [*m.parameters(), m.bn.running_mean]:
                    t.mul_(1.1).add_(0.01 * step)
    frozen = [r for r in reports if r.frozen]
    assert frozen and "weights changed" in frozen[0].fallback


class _Pool:
    """Stands in for a replayed graph: its gradient output lives in one buffer that the next
    "replay" overwrites, as a CUDA-graph pool's does. Only the storage is kept, so that
    AccumulateGrad may steal the tensor (as it steals the trees' outputs)."""

    def __init__(self):
        self.storage = None

    def pointer(self):
        return self.storage.data_ptr()

    def __call__(self, w, x):
        pool = self

        class Replayed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, w, x):
                return (w * x).sum()

            @staticmethod
            def backward(ctx, g):
                if pool.storage is None:
                    pool.storage = torch.empty(3).untyped_storage()
                out = torch.empty(0).set_(pool.storage, 0, (3,), (1,))
                out.copy_(g * x)  # written in place: the pool's one buffer
                return out, None

        return (Replayed.apply(w, x),)


def test_gradients_never_reach_the_caller_in_the_pool(monkeypatch):
    from fxopt.compile import training

    generation = [0]
    monkeypatch.setattr(training, "_generation", lambda: generation[0])
    pool = _Pool()
    step = PlainOutputs(pool, [True])
    w, x = torch.randn(3, requires_grad=True), torch.randn(3)
    (got,) = torch.autograd.grad(step(w, x)[0], [w])  # returned to the caller: a copy
    assert got.data_ptr() != pool.pointer()
    step(w, x)[0].backward()  # .grad was None: AccumulateGrad steals the pool's buffer
    assert w.grad.data_ptr() == pool.pointer()
    step(w, 2 * x)  # same generation (a graph of the same step): nothing copied
    assert w.grad.data_ptr() == pool.pointer()
    generation[0] += 1  # the next step: .grad is copied out before the replay
    loss = step(w, 2 * x)[0]
    assert w.grad.data_ptr() != pool.pointer()
    torch.testing.assert_close(w.grad, x)
    loss.backward()  # accumulates into the copy; the pool's buffer is overwritten
    torch.testing.assert_close(w.grad, 3 * x)
    torch.testing.assert_close(got, x)


def test_a_dropped_models_stolen_gradients_are_neither_kept_nor_touched(monkeypatch):
    """A gradient stolen into ``.grad`` is noted, for a copy before a later generation's
    replay, only as long as its leaf lives: a model dropped after its last step (a test's,
    a finished run's) is not kept alive, with its gradients in the pool, by that note, and
    the next replayed graph's call, of another model (after ``torch._dynamo.reset()`` tore
    the old trees down), does not reach into it."""
    import gc
    import weakref

    from fxopt.compile import training

    generation = [0]
    monkeypatch.setattr(training, "_generation", lambda: generation[0])
    w = torch.randn(3, requires_grad=True)
    pool = _Pool()
    PlainOutputs(pool, [True])(w, torch.randn(3))[0].backward()
    assert w.grad.data_ptr() == pool.pointer()  # stolen into .grad, and noted
    dropped = weakref.ref(w)
    del w
    gc.collect()
    assert dropped() is None
    generation[0] += 1
    fresh, = PlainOutputs(lambda x: [x * 2], [True])(torch.ones(2))
    assert torch.equal(fresh, torch.full((2,), 2.0)) and not training._PENDING.grads


def test_what_the_backward_hook_calls_is_imported_before_any_backward():
    """The hook on a replayed graph's backward node runs inside the autograd engine: an
    import there (Inductor's CUDA-graph tree manager, on its first call) left torch 2.11's
    garbage collector to crash later. So importing fxopt.compile.training imports it."""
    code = "import sys, fxopt.compile.training; print('torch._inductor.cudagraph_trees' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]
