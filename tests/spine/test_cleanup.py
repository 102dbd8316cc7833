"""Soundness of the cleanup passes: what they must remove, and what they must never touch."""

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt

aten = torch.ops.aten


def _run(module_or_gm, passes, *inputs):
    """Optimize, then check equivalence on fresh clones of the inputs (mutations included)."""
    gm = module_or_gm if isinstance(module_or_gm, fx.GraphModule) else fx.symbolic_trace(module_or_gm)
    out = fxopt.optimize(gm, passes=passes, example_inputs=inputs or None)
    for _ in range(2):
        fresh = [torch.randn_like(x) if x.is_floating_point() else x.clone() for x in inputs]
        a = [x.clone() for x in fresh]
        b = [x.clone() for x in fresh]
        torch.manual_seed(1)
        expected = gm(*a)
        torch.manual_seed(1)
        actual = out(*b)
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        for x, y in zip(a, b):  # in-place effects on inputs are part of the function
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    return out


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


# --- dce -----------------------------------------------------------------------------

class _UnusedInplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = x * 2
        y.add_(1)            # result unused: mutates y, which is returned
        torch.relu_(y)       # likewise
        z = y.clone()
        self.act(z)          # nn.ReLU(inplace=True), result unused
        unused = y.sin()     # truly dead  # noqa: F841
        return y, z


def _with_unused_iadd(model):
    """symbolic_trace records `z += 3` as an out-of-place add; Dynamo keeps operator.iadd."""
    gm = fx.symbolic_trace(model)
    clone = next(n for n in gm.graph.nodes if n.target == "clone")
    with gm.graph.inserting_after(clone):
        gm.graph.call_function(operator.iadd, (clone, 3.0))
    gm.recompile()
    return gm


def test_dce_keeps_unused_inplace_results_but_removes_dead_pure_code():
    out = _run(_with_unused_iadd(_UnusedInplace()), ["dce"], torch.randn(5))
    targets = _targets(out)
    assert "add_" in targets and torch.relu_ in targets and operator.iadd in targets and "act" in targets
    assert "sin" not in targets
    # torch's own DCE would drop the in-place ops and change the result
    reference = _with_unused_iadd(_UnusedInplace())
    reference.graph.eliminate_dead_code()
    reference.recompile()
    x = torch.randn(5)
    assert not torch.equal(reference(x.clone())[1], out(x.clone())[1])


class _Effects(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)  # training mode: updates running stats
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        self.bn(x)               # unused, but mutates running_mean/var
        torch.rand_like(x)       # unused random draw: keeps the RNG stream identical
        x.mul_(2)                # mutates the caller's input
        self.w * 3               # dead get_attr + mul
        return x + 1


def test_dce_keeps_state_updates_random_draws_and_input_mutation():
    model = _Effects().train()
    out = fxopt.optimize(fx.symbolic_trace(model), passes=["dce"])
    targets = _targets(out)
    assert "bn" in targets and torch.rand_like in targets and "mul_" in targets
    assert "w" not in targets and operator.mul not in targets
    x = torch.randn(2, 4)
    x2 = x.clone()
    out(x2)
    torch.testing.assert_close(x2, x * 2)
    assert out.bn.num_batches_tracked.item() == 1


def test_dce_keeps_opaque_user_leaf_modules():
    class Logger(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.log = Logger()

        def forward(self, x):
            self.log(x)
            return x * 2

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Logger) or super().is_leaf_module(m, qualname)

    model = M()
    gm = fx.GraphModule(model, Tracer().trace(model))
    out = fxopt.optimize(gm, passes=["dce"])
    assert "log" in _targets(out)


# --- cse -----------------------------------------------------------------------------

def test_cse_merges_pure_twins_and_duplicate_attribute_reads():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return (x * self.w).sum() + (x * self.w).sum()

    out = _run(M(), ["cse", "dce"], torch.randn(3, 4))
    assert _targets(out).count("w") == 1 and _targets(out).count(operator.mul) == 1


def test_cse_never_merges_random_ops():
    class M(nn.Module):
        def forward(self, x):
            a = torch.rand_like(x) + F.dropout(x, 0.5, training=True)
            b = torch.rand_like(x) + F.dropout(x, 0.5, training=True)
            return a - b

    gm = fx.symbolic_trace(M())
    out = fxopt.optimize(gm, passes=["cse", "dce"])
    assert _targets(out).count(torch.rand_like) == 2 and _targets(out).count(F.dropout) == 2
    assert out(torch.ones(100)).abs().sum() > 0


def test_cse_does_not_merge_across_an_inplace_write():
    class M(nn.Module):
        def forward(self, x):
            y = x * 1.5
            a = y + 1
            y.add_(1)
            b = y + 1
            return a, b

    out = _run(M(), ["cse", "dce"], torch.randn(4))
    assert _targets(out).count(operator.add) == 2


def test_cse_then_inplace_never_writes_a_storage_the_merged_twin_still_needs():
    """After cse merged ``b`` into its twin ``a``, ``b``'s view is a view of ``a``: the
    storages the alias analysis sees must say so, or ``inplace`` turns ``relu(view)`` into
    ``relu_(view)`` and overwrites ``a`` before ``a.sum()`` reads it."""

    class M(nn.Module):
        def forward(self, x):
            a = x * 3
            b = x * 3
            w = torch.relu(b.view(-1))
            return w.sum() + a.sum()

    out = _run(M(), ["cse", "inplace"], torch.randn(4, 4))
    assert _targets(out).count(operator.mul) == 1  # merged, and still right


def test_shapes_after_a_change_start_from_the_inputs_not_from_what_the_graph_did_to_them():
    """The run's shape propagations share one fake mode; a graph that changes an input's
    metadata in place (``unsqueeze_``) must not leave the next propagation (after cse
    changed the graph) starting from the changed fake input."""

    class M(nn.Module):
        def forward(self, x):
            a = torch.sigmoid(x) + torch.sigmoid(x)
            x.unsqueeze_(0)
            return a + x

    gm = fx.symbolic_trace(M())
    out = fxopt.optimize(gm, ["cse", "eliminate_identity", "dce"], example_inputs=(torch.randn(3, 4),))
    assert fxopt.report_of(out).find("cse")[0].changed
    sigmoid, total, _ = (n for n in out.graph.nodes if n.op == "call_function")  # x + x, then + x
    assert tuple(sigmoid.meta["val"].shape) == (3, 4) and tuple(total.meta["val"].shape) == (3, 4)
    assert tuple(out.graph.output_node().meta["val"].shape) == (1, 3, 4)


@pytest.mark.parametrize(("c1", "c2"), [(1, 1.0), (1, True), (0.0, -0.0)])
def test_cse_distinguishes_scalars_that_compare_equal(c1, c2):
    class M(nn.Module):
        def forward(self, x):
            return x * c1, x * c2

    x = torch.tensor([1, -2, 3]) if not isinstance(c1, float) else torch.tensor([1.0, -2.0])
    out = _run(M(), ["cse"], x)
    assert _targets(out).count(operator.mul) == 2


def test_cse_on_aten_graphs_merges_pure_ops_but_not_seeded_random_ones():
    def f(x):
        a = aten.add.Tensor(aten.mul.Tensor(x, x), aten.mul.Tensor(x, x))
        r = aten.rand.default([4]) + aten.rand.default([4])
        return a, r

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(torch.randn(4))
    out = fxopt.optimize(gm, passes=["cse", "dce"])
    assert _targets(out).count(aten.mul.Tensor) == 1
    assert _targets(out).count(aten.rand.default) == 2


# --- constant_fold -------------------------------------------------------------------

class _Foldable(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        w = self.w.t().contiguous() * torch.sigmoid(self.b)  # depends only on parameters
        noise = torch.rand_like(self.b) * self.b              # random: never folded
        return x @ w + self.b.exp(), noise


def test_constant_fold_folds_parameter_subgraphs_bitwise_and_keeps_random_ops():
    model = _Foldable().eval()
    gm = fx.symbolic_trace(model)
    out = fxopt.optimize(gm, passes=["constant_fold"])
    record = fxopt.report_of(out).find("constant_fold")[0]
    assert record.stats["folded"] == 2
    targets = _targets(out)
    assert torch.sigmoid not in targets and "t" not in targets and "exp" not in targets
    assert torch.rand_like in targets
    x = torch.randn(3, 8)
    torch.testing.assert_close(out(x)[0], gm(x)[0], rtol=0, atol=0)
    assert not torch.equal(out(x)[1], out(x)[1])  # still random after folding
    assert sorted(dict(gm.named_parameters())) == ["b", "w"]  # user's model untouched


def test_constant_fold_buffers_never_share_storage_with_the_users_tensors():
    """A computed result in a storage of its own is kept as the buffer; a second view of
    it (``fresh.t()``, ``fresh[0:2]``) is copied; a mere view of a parameter (``w.t()``,
    ``w.float()`` of a float ``w``) computes nothing and stays in the graph."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            fresh = self.w * 2
            return x @ self.w.t() + x @ self.w.float() + x @ fresh + x @ fresh.t() + x @ fresh[0:4]

    model = M().eval()
    out = fxopt.optimize(fx.symbolic_trace(model), passes=["constant_fold"])
    stats = fxopt.report_of(out).find("constant_fold")[0].stats
    assert stats["folded"] == 3 and stats["views_kept"] == 2
    assert "t" in _targets(out) and "float" in _targets(out)
    folded = [b for name, b in out.named_buffers() if name.startswith("_folded")]
    pointers = {b.untyped_storage().data_ptr() for b in folded}
    assert len(folded) == 3 == len(pointers)
    assert model.w.untyped_storage().data_ptr() not in pointers
    x = torch.randn(3, 4)
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)


def test_constant_fold_copies_a_slice_rather_than_keep_its_whole_temporary_alive():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(256, 64))

        def forward(self, x):
            return x + (self.w * 2)[0:1]

    model = M().eval()
    out = fxopt.optimize(fx.symbolic_trace(model), passes="constant_fold{max_bytes=1000}")
    (folded,) = [b for name, b in out.named_buffers() if name.startswith("_folded")]
    assert folded.shape == (1, 64) and folded.untyped_storage().nbytes() == 64 * 4  # not 256 rows
    x = torch.randn(3, 64)
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)


def test_constant_fold_respects_the_size_cap():
    gm = fx.symbolic_trace(_Foldable().eval())
    out = fxopt.optimize(gm, passes="constant_fold{max_bytes=100}")
    stats = fxopt.report_of(out).find("constant_fold")[0].stats
    assert stats["folded"] == 1 and stats["too_large"] == 1  # the 8x8 product is 256 bytes


# --- remove_dropout ------------------------------------------------------------------

class _Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)
        self.drop2d = nn.Dropout2d(0.3)

    def forward(self, x):
        x = self.drop(x)
        x = F.dropout(x, 0.2, training=False)
        x = F.dropout(x, 0.2, self.training)
        return self.drop2d(x)


def test_remove_dropout_only_removes_disabled_dropout():
    out = _run(_Dropouts().eval(), ["remove_dropout"], torch.randn(2, 3, 4, 4))
    assert not any(t in ("drop", "drop2d", F.dropout) for t in _targets(out))
    train = fxopt.optimize(fx.symbolic_trace(_Dropouts().train()), passes=["remove_dropout"])
    assert _targets(train).count(F.dropout) == 1  # training=False one removed, the live one kept
    assert "drop" in _targets(train) and "drop2d" in _targets(train)


def test_remove_dropout_on_aten_dropout_with_train_false():
    graph = fx.Graph()
    x = graph.placeholder("x")
    d = graph.call_function(aten.dropout.default, (x, 0.5, False))
    graph.output(graph.call_function(aten.relu.default, (d,)))
    gm = fx.GraphModule(nn.Module(), graph)
    out = _run(gm, ["remove_dropout"], torch.randn(6))
    assert aten.dropout.default not in _targets(out)


# --- eliminate_identity --------------------------------------------------------------

class _Identities(nn.Module):
    def __init__(self):
        super().__init__()
        self.id = nn.Identity()

    def forward(self, x, h):
        a = self.id(x).contiguous().float().view(x.shape).permute(0, 1)
        b = x.t().contiguous()      # a real copy: kept
        c = h.float()               # a real cast: kept
        d = x.permute(1, 0)         # a real permute: kept
        return a, b, c, d


def test_eliminate_identity_removes_only_true_no_ops():
    out = _run(_Identities(), ["eliminate_identity", "dce"], torch.randn(3, 4), torch.randn(3, 4).half())
    targets = _targets(out)
    assert "id" not in targets and "view" not in targets
    assert targets.count("contiguous") == 1 and targets.count("float") == 1
    assert targets.count("permute") == 1
    record = fxopt.report_of(out).find("eliminate_identity")[0]
    assert record.stats["removed"] == 5


def test_eliminate_identity_without_shapes_only_applies_shape_free_rules():
    out = fxopt.optimize(fx.symbolic_trace(_Identities()), passes=["eliminate_identity"])
    record = fxopt.report_of(out).find("eliminate_identity")[0]
    assert record.stats["removed"] == 1 and "no shapes" in record.stats["shape_rules"]
