"""``BudgetPartitioner`` on its own: joint graphs partitioned through ``aot_module`` with no
compiler (no Inductor: a second per case), the decision it reports held to its contract and
to the bytes autograd sees saved, the step held to eager's, and the activation-peak
prediction held to a count by hand. (tests/memory/test_budget_training.py runs the budget
through fxopt.compile and Inductor.)"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from functorch.compile import aot_module, make_boxed_func, min_cut_rematerialization_partition
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.memory.budget import BudgetPartitioner, activation_peak


def _no_compiler(gm, example_inputs):
    return make_boxed_func(gm)


class MLP(nn.Module):
    """Three linears, ReLU, tanh, a square, and dropout twice (its draws must be eager's)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x):
        h = F.dropout(torch.relu(self.a(x)), 0.5, True)
        h = F.dropout(torch.tanh(self.b(h)), 0.5, True)
        return self.c(h * h)


def _step(partition_fn):
    """One step of a fresh MLP (seeded) through ``partition_fn`` (None: eager): the bytes of
    the storages autograd saves for the backward (parameters and the batch left out),
    output, gradients and the generator's state after the step."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(32, 64)
    fn = model if partition_fn is None else aot_module(model, fw_compiler=_no_compiler, bw_compiler=_no_compiler,
                                                       partition_fn=partition_fn)
    if partition_fn is not None:
        fn(x).sum().backward()  # traces and partitions outside the hooks
        model.zero_grad(set_to_none=True)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    out.square().sum().backward()
    return sum(saved.values()), out.detach(), [p.grad for p in model.parameters()], torch.get_rng_state()


@functools.cache
def _stock_saved():
    return _step(functools.partial(min_cut_rematerialization_partition, compiler="inductor"))[0]


@pytest.mark.parametrize(("budget", "max_recompute"), [(1.0, 0.3), (0.9, 0.3), (0.5, 0.3), (0.05, 0.02)])
def test_the_decision_is_what_autograd_saves_and_the_step_is_eagers(budget, max_recompute):
    """The decision's bytes before and after are the bytes autograd sees saved with the stock
    min-cut and with this partition; it says why it stopped short exactly when the bytes are
    above the budget; it recomputes at most ``max_recompute`` of the graph's estimated cost;
    output, gradients and dropout draws are eager's (float32: 1e-5 relative)."""
    reports = []
    saved, out, grads, rng = _step(BudgetPartitioner(budget, max_recompute=max_recompute, reports=reports))
    (decision,) = reports
    assert decision.budget == budget
    assert (decision.saved_before, decision.saved_after) == (_stock_saved(), saved)
    assert saved <= decision.saved_before
    assert (decision.short is None) == (saved <= budget * decision.saved_before), decision
    assert decision.recompute_share <= max_recompute, decision
    assert (decision.recompute_share == 0) == (not decision.recomputed)
    _, want_out, want_grads, want_rng = _step(None)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(rng, want_rng)


def test_a_budget_the_stock_partition_meets_recomputes_nothing():
    reports = []
    _step(BudgetPartitioner(1.0, reports=reports))
    assert reports[0].recomputed == [] and reports[0].short is None


def test_the_cache_key_follows_budget_and_allowance():
    """Inductor's FX graph cache keys a compiled graph by the partitioner's ``uuid``: two
    budgets (or allowances) sharing one would share each other's partitions."""
    key = BudgetPartitioner(0.5).uuid()
    assert key == BudgetPartitioner(0.5, reports=[]).uuid()
    assert len({key, BudgetPartitioner(0.3).uuid(), BudgetPartitioner(0.5, max_recompute=0.1).uuid()}) == 3


def test_the_activation_peak_counts_each_storage_from_its_definition_to_its_last_use():
    """Forward ``a = p * 2; b = a + 1; c = b * b`` saving ``a``, backward ``d = t * a;
    e = cat(d, a)``, over 1024 floats (4 KiB each, ``e`` 8 KiB). Counted by hand, a value
    live at the node that defines it through the node that last reads it (an output to the
    end; the forward's parameter ``p`` never counts, the backward's inputs do): the forward
    peaks at c (a, b, c: 12 KiB), the backward at e (a, d, e: 16 KiB)."""

    def forward(primals_1):
        a = primals_1 * 2
        b = a + 1
        return b * b, a

    def backward(a, tangents_1):
        d = tangents_1 * a
        return (torch.cat([d, a]),)

    kib = 1024
    fw = make_fx(forward, tracing_mode="fake")(torch.randn(1024))
    bw = make_fx(backward, tracing_mode="fake")(torch.randn(1024), torch.randn(1024))
    assert activation_peak(fw, bw) == 16 * kib
    bw_small = make_fx(lambda a, tangents_1: (tangents_1 + 1,), tracing_mode="fake")(torch.randn(1024),
                                                                                   torch.randn(1024))
    assert activation_peak(fw, bw_small) == 12 * kib  # the forward's: the backward's own is 8 KiB
