"""fx_graphs, inputs_for, pipelines: valid graphs, finite values, coverage, shrinking."""

from __future__ import annotations

import operator
import random

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from fxopt.errors import InputError
from fxopt.registry import registered_passes
from fxopt.testing.minimize import node_count
from fxopt.testing.strategies import OP_KINDS, build_graph, fx_graphs, inputs_for, pipelines


def budget(examples: int) -> settings:
    return settings(deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    max_examples=examples)


@budget(60)
@given(st.data(), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_graphs_run_with_the_recorded_shapes_and_stay_finite(data, dtype):
    gm = data.draw(fx_graphs(1, 40, dtype=dtype))
    gm.graph.lint()
    inputs = data.draw(inputs_for(gm))
    outputs = gm(*inputs)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    assert isinstance(outputs, tuple) and len(outputs) == len(output_node.args[0])
    for value, node in zip(outputs, output_node.args[0]):
        assert value.shape == node.meta["val"].shape and value.dtype == dtype, node.format_node()
        assert torch.isfinite(value).all(), node.format_node()


def test_at_least_forty_op_kinds_and_all_of_them_are_emitted():
    assert len(OP_KINDS) >= 40
    for required in ("view", "reshape", "permute", "cat", "split", "matmul", "conv", "layer_norm",
                     "batch_norm", "sum", "amax", "add", "mul"):
        assert required in OP_KINDS
    rng = random.Random(0)
    seen: set[str] = set()
    for seed in range(300):
        gm = build_graph(rng.randbytes(16 * 31), seed)
        seen.update(gm.meta["fxopt.op_kinds"])
    # a kind that never applies is a generator bug (its draws would all fall back to relu)
    assert seen == set(OP_KINDS), sorted(set(OP_KINDS) - seen)


def test_unknown_op_kinds_are_rejected():
    with pytest.raises(ValueError, match="unknown op kinds \\['nope'\\]"):
        find(fx_graphs(ops=["nope"]), lambda gm: True)


def test_shrinking_reaches_a_tiny_graph():
    def has_sub(gm: fx.GraphModule) -> bool:
        return any(n.target in (operator.sub, torch.sub, "sub") for n in gm.graph.nodes)

    # derandomized: the shrink result must not depend on the luck of one run
    smallest = find(fx_graphs(1, 40), has_sub,
                    settings=settings(database=None, max_examples=2000, derandomize=True))
    assert has_sub(smallest)
    assert node_count(smallest) <= 5, smallest.code  # an input, maybe a constant, the sub (typically 2-3)


def test_inputs_for_names_the_placeholder_it_cannot_fill():
    gm = fx.symbolic_trace(torch.nn.Linear(3, 3))
    with pytest.raises(InputError, match="placeholder 'input_1' has no meta"):
        inputs_for(gm)


@budget(20)
@given(pipelines())
def test_pipelines_draw_registered_pass_names(pipeline):
    assert 1 <= len(pipeline) <= 4 and set(pipeline) <= set(registered_passes())


def _draw_only(examples: int) -> settings:
    """Settings for drawing ``examples`` graphs in the generate phase only, as a property
    test draws them before its body runs."""
    return settings(deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    max_examples=examples, phases=[Phase.generate])


# 10,000 draws take about a minute each: the long profile runs them; CI draws 1,000.
@pytest.mark.parametrize("examples", [1_000, pytest.param(10_000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("effects", [False, True], ids=["pure", "effects"])
def test_drawing_graphs_never_raises(examples, effects):
    drawn = []

    @_draw_only(examples)
    @given(fx_graphs(20, 50, effects=effects))
    def draw(gm: fx.GraphModule) -> None:
        drawn.append(gm)

    draw()  # an exception raised while drawing would fail a user's (correct) property test
    assert len(drawn) == examples


@_draw_only(300)
@given(fx_graphs(20, 50, ops=["cat", "scalar_arith", "prod"]))
def test_products_over_long_dimensions_are_bounded_without_overflow(gm):
    # cat grows a dimension past 400 elements and scalar_arith the bound past 1: the bound of
    # a product over it, bound ** n, is past the largest float (it used to raise OverflowError)
    assert gm.meta["fxopt.op_kinds"]
