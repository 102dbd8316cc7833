"""Dogfooding: fxopt's own passes, tested with fxopt.testing.

Every registered pass that promises equivalence (all but ``quantize``, which is lossy by
design and has its own error budget in tests/quant) runs over the model zoo in fp32,
fp16 and bf16 with zero false alarms tolerated, and over random graphs from
``fx_graphs`` in random pipelines (a few hundred examples in CI, 10,000 with
FXOPT_PROFILE=long).
"""

from __future__ import annotations

import operator
import os

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxopt
from fxopt.testing import check_pass, input_specs
from fxopt.testing.strategies import fx_graphs, inputs_for, pipelines

LONG = os.environ.get("FXOPT_PROFILE") == "long"
LOSSY = {"quantize"}  # int8: checked against its own error budget, not equivalence
SOUND = sorted(set(fxopt.registered_passes()) - LOSSY)
CLEANUP = ["dce", "cse", "constant_fold", "remove_dropout", "eliminate_identity"]


def in_order(names: list[str]) -> list[str]:
    """``names`` ordered so that every pass's declared ``after``/``before`` holds."""
    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    for name in names:
        cls = fxopt.get_pass_class(name)
        graph.add_edges_from((other, name) for other in cls.after if other in names)
        graph.add_edges_from((name, other) for other in cls.before if other in names)
    return list(nx.lexicographical_topological_sort(graph))


def examples(ci: int, long: int) -> settings:
    return settings(max_examples=long if LONG else ci, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.fxopt_exclude_tags(*(() if LONG else ("large",)))
@pytest.mark.fxopt_dtypes("float32")
@pytest.mark.parametrize("pass_name", SOUND)
def test_each_pass_on_the_zoo_in_fp32(fx_case, check_pass, pass_name):
    check_pass([pass_name], fx_case)


@pytest.mark.fxopt_exclude_tags(*(() if LONG else ("large",)))
@pytest.mark.fxopt_dtypes("float16", "bfloat16")
def test_all_passes_together_on_the_zoo_in_low_precision(fx_case, check_pass):
    check_pass(in_order(SOUND), fx_case)


@pytest.mark.slow
@pytest.mark.fxopt_dtypes("float16", "bfloat16")
@pytest.mark.parametrize("pass_name", SOUND)
def test_each_pass_on_the_zoo_in_low_precision(fx_case, check_pass, pass_name):
    check_pass([pass_name], fx_case)


@examples(ci=120, long=10_000)
@given(st.data(), pipelines(SOUND, max_size=3),
       st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
def test_random_pipelines_on_random_graphs(data, pipeline, dtype):
    gm = data.draw(fx_graphs(1, 25, dtype=dtype))
    inputs = data.draw(inputs_for(gm))
    check_pass(in_order(list(dict.fromkeys(pipeline))), gm, inputs)


@examples(ci=40, long=2_000)
@given(fx_graphs(1, 25), st.sampled_from(CLEANUP))
def test_cleanup_passes_are_idempotent(gm, pass_name):
    inputs = tuple(spec.make(torch.Generator().manual_seed(0)) for spec in input_specs(gm))
    once = fxopt.optimize(gm, passes=[pass_name], example_inputs=inputs)
    twice = fxopt.optimize(once, passes=[pass_name], example_inputs=inputs)
    assert twice.code == once.code


@examples(ci=40, long=2_000)
@given(fx_graphs(1, 25), st.permutations(["cse", "dce", "eliminate_identity"]))
def test_cleanup_order_does_not_change_the_result(gm, order):
    """cse, dce and eliminate_identity commute up to a final dce: each only removes nodes
    or merges them, so any order ends in an equivalent graph of the same size."""
    inputs = tuple(spec.make(torch.Generator().manual_seed(0)) for spec in input_specs(gm))
    reference = check_pass(["cse", "dce", "eliminate_identity", "dce"], gm, inputs)
    other = check_pass([*order, "dce"], gm, inputs)
    assert len(other.graph.nodes) == len(reference.graph.nodes)


class TwinsThenWrite(torch.nn.Module):
    """Found by test_cleanup_order_does_not_change_the_result: two identical computations,
    one of them later written in place (through a view). Merging them leaked the write."""

    def forward(self, x):
        a = x * 2.0
        b = x * 2.0
        a.view(-1).add_(1.0)
        untouched_twin_1 = torch.relu(x)
        untouched_twin_2 = torch.relu(x)
        torch.sigmoid(x).mul_(3.0)  # a write to a fresh tensor: no reason to stop merging
        return b, a, untouched_twin_1 + untouched_twin_2


@pytest.mark.parametrize("with_shapes", [True, False], ids=["alias-analysis", "no-shapes"])
def test_cse_never_merges_a_value_that_is_written_later(with_shapes):
    gm = torch.fx.symbolic_trace(TwinsThenWrite())
    x = torch.randn(3, 4)
    optimized = fxopt.optimize(gm, passes=["cse"], example_inputs=(x,) if with_shapes else None)
    from fxopt.testing import assert_equivalent

    assert_equivalent(gm, optimized, (x,))
    targets = [n.target for n in optimized.graph.nodes]
    assert targets.count(torch.relu) == 1  # the untouched twins are still merged
    assert sum(t is operator.mul for t in targets) == 2  # the written twins are not
